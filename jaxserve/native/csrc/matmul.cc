// jaxserve's native CPU matmul kernels, reached from the jitted programs as XLA FFI custom calls
// (registered for the CPU platform by jaxserve.native): decode kernels for small batches, and
// on CPUs with AMX tile kernels for many rows (amx.inc; isa.inc says which run).
//
// Every kernel computes y[M, N] = x[M, K] . decode(w)[K, N] reading w as jaxserve stores it
// (row-major [K, N], N contiguous), one strip of columns at a time, decoded in registers and
// multiplied into up to 4 rows x the strip's accumulators. Nothing dense is ever written. A
// strip is read once per 4 rows of x (it stays in L2 between row chunks), so the cost is the
// weight's stored bytes for the batches decode runs (M <= 8).
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
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <cstring>
#include <thread>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kExactChunk = 1024;

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::function<void(int64_t)> fn;
};

int64_t ThreadCap() {
  static const int64_t cap = [] {
    const char* s = std::getenv("JAXSERVE_NATIVE_THREADS");
    int64_t v = s ? std::atoll(s) : 0;
    return v > 0 ? v : int64_t(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cap;
}

void Work(Job& job) {
  for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.total;) {
    job.fn(i);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// fn(chunk) for chunk in [0, total), over the pool's threads and the caller.
void ParallelFor(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  int64_t threads = std::min({pool.num_threads(), ThreadCap(), total});
  if (threads <= 1) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->total = total;
  job->fn = std::move(fn);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// ----------------------------------------------------------------------------- AVX-512
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
struct Isa {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kRows = 4;  // 4 rows x 4 vectors = 16 of the 32 zmm registers
  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreF(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F Int8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F Bf16(const uint16_t* p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  // e4m3fn -> f16 bits: the byte sign-extended to 16 bits and shifted by 7 puts exponent and
  // mantissa at bits 7..13 and the sign at 14..15; clearing bit 14 leaves the f16 of 2^-8 x
  // the value, for subnormals and NaN too (the f16 -> f32 convert takes f16 subnormals whatever
  // the thread's denormals-are-zero mode); the caller folds the 2^8 into the scales.
  static F Fp8(const uint8_t* p) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(int16_t(0xBFFF))));
  }
};
#include "kernels.inc"
#include "bf16.inc"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
#include "vnni.inc"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,amx-tile,amx-bf16,amx-int8,f16c,fma")
#include "amx.inc"
#pragma GCC pop_options
}  // namespace avx512

// ----------------------------------------------------------------------------- AVX2
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
struct Isa {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kRows = 2;  // 2 rows x 4 vectors = 8 of the 16 ymm registers
  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreF(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F Int8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F Bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static F Fp8(const uint8_t* p) {  // as avx512::Isa::Fp8
    __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
    return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(int16_t(0xBFFF))));
  }
};
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

void Int4Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t Kp, const uint8_t* w, int64_t N,
              const float* s, int64_t G, float* y) {
  if (UseAmx(kInt4, M))
    avx512::amx::RunInt4(pool, x, M, Kp, w, N, s, G, y);
  else if (IsaLevel() >= 3)
    avx512::vnni::RunW4A8(pool, x, M, Kp, w, N, s, G, y);
  else
    avx2::madd::RunW4A8(pool, x, M, Kp, w, N, s, G, y);
}

void Int8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
              const float* s, float* y) {
  if (UseAmx(kInt8, M))
    avx512::amx::RunW8A8(pool, x, M, K, w, N, s, y);
  else if (IsaLevel() >= 3)
    avx512::vnni::RunW8A8(pool, x, M, K, w, N, s, y);
  else
    avx2::madd::RunW8A8(pool, x, M, K, w, N, s, y);
}

void Fp8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
             const float* s, int64_t bk, int64_t bn, float* y) {
  if (UseAmx(kFp8, M))
    avx512::amx::RunFp8(pool, x, M, K, w, N, s, bk, bn, y);
  else
    JAXSERVE_ISA(RunFp8(pool, x, M, K, w, N, s, bk, bn, y));
}

void Bf16Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  if (UseAmx(kBf16, M))
    avx512::amx::RunBf16(pool, x, M, K, w, N, y);
  else if (IsaLevel() >= 2)
    avx512::split::RunBf16(pool, x, M, K, w, N, y);
  else
    avx2::RunBf16(pool, x, M, K, w, N, y);
}

void F32Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  JAXSERVE_ISA(RunF32(pool, x, M, K, w, N, y));
}

void ExactRows(ffi::ThreadPool& pool, const int8_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int32_t* y) {
  if (UseAmx(kInt8, M))
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
// The fewest rows a call of format f (0 bf16, 1 int8, 2 int4, 3 fp8) needs to run on the AMX
// kernels (where the level is 4; 1 << 30: never).
extern "C" int jaxserve_native_amx_rows(int f) { return int(AmxRows(std::clamp(f, 0, kFormats - 1))); }
// Sets it for every format, -1 back to the defaults (a benchmark loads a second copy of the
// library and turns AMX off in that copy).
extern "C" void jaxserve_native_set_amx_rows(int rows) { amx_rows_set.store(rows, std::memory_order_relaxed); }
