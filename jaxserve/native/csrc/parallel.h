// Work shared by the native kernels: over their own crew of helper threads (below), or XLA's
// intra-op thread pool (the FFI ThreadPool).
#pragma once

#include <cstdint>
#include <functional>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_native {

// The most threads a kernel uses: JAXSERVE_NATIVE_THREADS, else the CPUs the process may run on.
int64_t ThreadCap();

// fn(chunk) for chunk in [0, total), over the crew (if there is one and no other call has it)
// or else the pool's threads, and the caller. Chunks are claimed
// from an atomic counter; the caller works too and waits only for chunks already claimed, so a
// task that starts late finds nothing left and nothing can deadlock. Inside a RunOn scope of
// this thread with `caller` on, the caller runs every chunk itself.
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn);

// The least work (a matmul's stored weight bytes times its rows) worth sharing with other
// threads: JAXSERVE_NATIVE_SHARE_BYTES, else kCrewShareBytes with the crew below, else
// kShareBytes. A pool thread that has gone to sleep between calls takes microseconds to wake,
// as long as a small call takes on one thread, so without the crew a decode step's small calls
// ran faster on the caller alone (BENCHMARKS.md, "Small calls on the caller").
constexpr int64_t kShareBytes = int64_t(1) << 20;
constexpr int64_t kCrewShareBytes = int64_t(64) << 10;
int64_t ShareBytes();

// The crew: ThreadCap() - 1 helper threads of the library's own that, after each call, keep
// polling for the next one for SpinNs() before they sleep, so a decode step's calls (tens of
// microseconds apart) are shared without a wake-up. JAXSERVE_NATIVE_SPIN_US sets the polling
// time in microseconds (0: no crew, XLA's pool as before); unset or "auto", a probe at first use
// (~70 ms, once a process) decides: the crew polls kSpinUs where two threads read memory at least kCrewProbe times as
// fast as one (each vCPU a core of its own), and there is no crew where they do not (two vCPUs
// of one core: a polling thread takes the load units the caller would use).
constexpr int64_t kSpinUs = 100;
constexpr double kCrewProbe = 1.3;
int64_t SpinNs();
double CrewProbe();  // the probe's ratio (two threads' read rate over one's), 0 if not measured

// Where ParallelFor calls made on this thread run while a RunOn is alive (scopes nest, each
// keeping what an outer one set): `caller`, on the calling thread alone; `pool`, on XLA's pool,
// never the crew. The matmuls and attention set `caller` for calls under ShareBytes() and `pool`
// for calls of at least PoolRows() rows (queries): the programs that make them (prefill) run
// their other ops on XLA's pool too, and a crew thread polling between such calls takes a CPU
// those ops want (an int8 prefill step 236 against 292 ms: BENCHMARKS.md, "Prefill on the AMX
// tiles, and the helper threads out of its way"). PoolRows(): JAXSERVE_NATIVE_POOL_ROWS, else
// kPoolRows.
class RunOn {
 public:
  RunOn(bool caller, bool pool);
  ~RunOn();
  RunOn(const RunOn&) = delete;
  RunOn& operator=(const RunOn&) = delete;

 private:
  bool was_caller_, was_pool_;
};
constexpr int64_t kPoolRows = 128;
int64_t PoolRows();

}  // namespace jaxserve_native
