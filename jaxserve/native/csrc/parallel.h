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
// task that starts late finds nothing left and nothing can deadlock. Inside an OnCaller scope
// of this thread that is on, the caller runs every chunk itself.
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn);

// The least work (a matmul's stored weight bytes times its rows) worth sharing with the pool:
// JAXSERVE_NATIVE_SHARE_BYTES, else kShareBytes. A pool thread that has gone to sleep between
// calls takes microseconds to wake, as long as a small call takes on one thread, so a decode
// step's small calls ran faster on the caller alone (BENCHMARKS.md, "Small calls on the caller").
constexpr int64_t kShareBytes = int64_t(1) << 20;
int64_t ShareBytes();

// While alive and `on`, ParallelFor calls made on this thread run on it alone (scopes nest).
class OnCaller {
 public:
  explicit OnCaller(bool on);
  ~OnCaller();
  OnCaller(const OnCaller&) = delete;
  OnCaller& operator=(const OnCaller&) = delete;

 private:
  bool was_;
};

}  // namespace jaxserve_native
