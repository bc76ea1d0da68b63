// Work shared over XLA's intra-op thread pool (the FFI ThreadPool) by the native kernels.
#pragma once

#include <cstdint>
#include <functional>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_native {

// The most threads a kernel uses: JAXSERVE_NATIVE_THREADS, else the machine's hardware threads.
int64_t ThreadCap();

// fn(chunk) for chunk in [0, total), over the pool's threads and the caller. Chunks are claimed
// from an atomic counter; the caller works too and waits only for chunks already claimed, so a
// task that starts late finds nothing left and nothing can deadlock.
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn);

}  // namespace jaxserve_native
