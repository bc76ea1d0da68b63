// The native matmul kernels as handlers.cc calls them: y[M, N] = x[M, K] . decode(w)[K, N] for
// one stored weight, each format on the kernel that serves M rows on this CPU (matmul.cc:
// AMX tiles, AVX512-VNNI or AVX2 integer dots, float kernels; isa.inc picks). Layouts as in
// matmul.cc's header. Every function spreads its work over the FFI's thread pool.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_native {

namespace ffi = xla::ffi;

// int4 groups: x f32 [M, Kp], w u8 [Kp/2, N], s f32 [Kp/G, N], G a multiple of 4.
void Int4Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t Kp, const uint8_t* w, int64_t N,
              const float* s, int64_t G, float* y);
// int8 per channel: w s8 [K, N], s f32 [1, N].
void Int8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
              const float* s, float* y);
// fp8 e4m3: w [K, N] bits, s f32 [ceil(K/bk), ceil(N/bn)].
void Fp8Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
             const float* s, int64_t bk, int64_t bn, float* y);
// bf16: w [K, N] bits.
void Bf16Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y);
// float32: w [K, N] (plain weights).
void F32Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y);
// Exact s8 x s8 -> s32.
void ExactRows(ffi::ThreadPool& pool, const int8_t* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int32_t* y);

}  // namespace jaxserve_native
