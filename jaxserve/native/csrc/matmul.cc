// jaxserve's native CPU matmul kernels, reached from the jitted programs as XLA FFI custom calls
// (registered for the CPU platform by jaxserve.native): decode kernels for small batches, and
// on CPUs with AMX tile kernels for many rows (amx.inc; isa.inc says which run).
//
// Every kernel computes y[M, N] = x[M, K] . decode(w)[K, N] reading w as jaxserve stores it
// (row-major [K, N], N contiguous), decoded in registers and multiplied into a few rows x a
// panel's accumulators. Nothing dense is ever written. Most kernels walk one strip of columns
// at a time down K, read once per chunk of rows of x (it stays in L2 between row chunks);
// the integer kernels on AVX512-VNNI (walk.inc) read whole stored rows in address order
// instead, one block of rows (an int4 group's, 16 int8 rows) at a time for all M rows. Either
// way the cost is the weight's stored bytes for the batches decode runs (M <= 8).
//   float kernels (kernels.inc, AVX2 and AVX-512; bf16.inc for AVX-512 bf16): bf16 and fp8
//     decoded to float32, f32 activations, FMA into f32 accumulators held in registers while
//     the strip walks K row by row (each stored row one contiguous run, prefetched ahead);
//   integer kernels: int4 groups as W4A8 and int8 as W8A8, the activations quantized to int8
//     in the kernel, exact int32 dots, scales in f32: vpdpbusd where cpuid has AVX512-VNNI
//     (vnni.inc), else AVX2's vpmaddubsw + vpmaddwd (madd.inc), the same numbers to the bit;
//   tile kernels (amx.inc, AMX-BF16 / AMX-INT8): B tiles packed per call from the stored bytes
//     into a thread-local buffer (256 KiB per thread, or one 32-column panel
//     where that is larger), 32 x 32 blocks of y.
//
// Formats (see jaxserve/quant/*.py for the layouts):
//   int4 groups  w u8 [Kp/2, N] (group tile: low nibbles rows t*G+j, high rows t*G+G/2+j),
//                scales f32 [Kp/G, N]; w = nibble * scale  (x f32 [M, Kp], zero-padded)
//   int8 channel w s8 [K, N], scales f32 [1, N]
//   fp8 e4m3     w u8 [K, N] (e4m3fn bits), scales f32 [ceil(K/bk), ceil(N/bn)]
//   bf16         w u16 [K, N] (bf16 bits), no scales
//   W8A8 exact   x s8 [M, K], w s8 [K, N] -> s32 [M, N]: products accumulate in float32 over
//                chunks of 1024 k (|partial sum| <= 1024 * 127 * 127 < 2^24: every partial sum
//                is an integer float32 holds exactly), then into int32: exact int32 result.
//
// Threads: the panels are shared out over XLA's intra-op thread pool (the FFI ThreadPool) by
// an atomic counter; the calling thread works too and waits only for panels already claimed,
// so a task that starts late finds nothing left and nothing can deadlock.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "aligned.h"
#include "parallel.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kExactChunk = 1024;

using jaxserve_native::ParallelFor;
using jaxserve_native::ThreadCap;
using jaxserve_native::AlignedVector;

// W4A8 splits K into at most kW4Chunks chunks of whole groups, sums each chunk from zero and
// adds the chunks in order (walk.inc on AVX512-VNNI, madd.inc on AVX2: the same bits on both).
// Two: one long stream a thread for the caller and one helper (four measured 3-7% slower per
// one-row decode step with the crew and 4-15% at 8 rows, six slower still: BENCHMARKS.md, "One
// core per decode program").
constexpr int64_t kW4Chunks = 2;
inline int64_t W4ChunkGroups(int64_t groups) {
  return std::max<int64_t>(1, (groups + kW4Chunks - 1) / kW4Chunks);
}

// ----------------------------------------------------------------------------- AVX-512
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
#include "simd512.inc"
#include "kernels.inc"
#include "bf16.inc"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
#include "vnni.inc"
#include "walk.inc"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,amx-tile,amx-bf16,amx-int8,f16c,fma")
#include "amx.inc"
#include "amx_calls.inc"
#pragma GCC pop_options
}  // namespace avx512

// ----------------------------------------------------------------------------- AVX2
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#include "simd256.inc"
#include "kernels.inc"
#include "madd.inc"
#pragma GCC pop_options
}  // namespace avx2

#include "isa.inc"

#define JAXSERVE_ISA(CALL) (IsaLevel() >= 2 ? (void)(avx512::CALL) : (void)(avx2::CALL))

}  // namespace

// ----------------------------------------------------------------------------- rows.h
// The kernel each format runs for M rows on this CPU (handlers.cc calls these for the dense and
// the grouped-by-expert custom calls).
namespace jaxserve_native {
namespace {

// A call of M rows against `bytes` of stored weight runs on the calling thread alone when its
// work is under ShareBytes() (parallel.h).
bool Small(int64_t bytes, int64_t M) { return bytes * std::max<int64_t>(M, 1) < ShareBytes(); }
// A call of at least PoolRows() rows shares XLA's pool, not the crew (parallel.h).
bool Many(int64_t M) { return M >= PoolRows(); }

}  // namespace

void Int4Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t Kp, const uint8_t* w, int64_t N,
              const float* s, int64_t G, float* y) {
  RunOn run_on(Small(Kp / 2 * N + Kp / G * N * 4, M), Many(M));
  if (UseAmx(kInt4, M))
    avx512::amx::RunInt4(pool, x, M, Kp, w, N, s, G, y);
  else if (IsaLevel() >= 3)
    avx512::vnni::RunW4A8Walk(pool, x, M, Kp, w, N, s, G, y);
  else
    avx2::madd::RunW4A8(pool, x, M, Kp, w, N, s, G, y);
}

void Int8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
              const float* s, float* y) {
  RunOn run_on(Small(K * N + 4 * N, M), Many(M));
  if (UseAmxInt8(M, K))
    avx512::amx::RunW8A8(pool, x, M, K, w, N, s, y);
  else if (IsaLevel() >= 3)
    avx512::vnni::RunW8A8(pool, x, M, K, w, N, s, y);
  else
    avx2::madd::RunW8A8(pool, x, M, K, w, N, s, y);
}

void Fp8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
             const float* s, int64_t bk, int64_t bn, float* y) {
  RunOn run_on(Small(K * N, M), Many(M));
  if (UseAmx(kFp8, M))
    avx512::amx::RunFp8(pool, x, M, K, w, N, s, bk, bn, y);
  else
    JAXSERVE_ISA(RunFp8(pool, x, M, K, w, N, s, bk, bn, y));
}

void Bf16Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  RunOn run_on(Small(2 * K * N, M), Many(M));
  if (UseAmx(kBf16, M))
    avx512::amx::RunBf16(pool, x, M, K, w, N, y);
  else if (IsaLevel() >= 2)
    avx512::split::RunBf16(pool, x, M, K, w, N, y);
  else
    avx2::RunBf16(pool, x, M, K, w, N, y);
}

void F32Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  RunOn run_on(Small(4 * K * N, M), Many(M));
  JAXSERVE_ISA(RunF32(pool, x, M, K, w, N, y));
}

void ExactRows(ffi::ThreadPool& pool, const int8_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int32_t* y) {
  RunOn run_on(Small(K * N, M), Many(M));
  if (UseAmx(kInt8, M))  // exact int32 (modulo 2^32) on either kernel, whatever K
    avx512::amx::RunExact(pool, x, M, K, w, N, y);
  else if (IsaLevel() >= 3)
    avx512::vnni::RunExactVnni(pool, x, M, K, w, N, y);
  else
    JAXSERVE_ISA(RunExact(pool, x, M, K, w, N, y));
}

}  // namespace jaxserve_native

// The instruction set the kernels run with: 4 AMX (+ 3's), 3 AVX-512 + VNNI, 2 AVX-512, 1 AVX2 (+FMA, F16C),
// 0 none (unusable).
extern "C" int jaxserve_native_isa() { return IsaLevel(); }
// The least work (stored weight bytes times rows) a matmul call shares with the thread pool;
// smaller calls run on the calling thread alone (parallel.h).
extern "C" int64_t jaxserve_native_share_bytes() { return jaxserve_native::ShareBytes(); }
// How long the crew's helper threads poll between calls, in microseconds (0: no crew), and the
// probe's ratio behind that choice (0: not measured; parallel.h).
extern "C" int64_t jaxserve_native_spin_us() { return jaxserve_native::SpinNs() / 1000; }
extern "C" double jaxserve_native_crew_probe() { return jaxserve_native::CrewProbe(); }
// Calls of at least this many rows (queries) share XLA's pool, never the crew (parallel.h).
extern "C" int64_t jaxserve_native_pool_rows() { return jaxserve_native::PoolRows(); }
// The fewest rows a call of format f (0 bf16, 1 int8, 2 int4, 3 fp8) needs to run on the AMX
// kernels (where the level is 4; 1 << 30: never).
extern "C" int jaxserve_native_amx_rows(int f) { return int(AmxRows(std::clamp(f, 0, kFormats - 1))); }
// Sets it for every format, -1 back to the defaults (a benchmark loads a second copy of the
// library and turns AMX off in that copy).
extern "C" void jaxserve_native_set_amx_rows(int rows) { amx_rows_set.store(rows, std::memory_order_relaxed); }
