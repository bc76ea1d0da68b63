// jaxserve's native paged attention for CPU: grouped-query attention of a step's queries over
// the K/V its pages hold, as an XLA FFI custom call (registered by jaxserve.native, run by the
// "native" attention backend for every GQA step: decode, speculative verify and prefill chunks).
//
//   q f32 [B, T, H, D] (row b's query t at position cached[b] + t), k / v pools [KVH, P, S, D]
//   as stored (float32; bf16 bits as u16 or bf16; e4m3fn as u8 or f8e4m3fn with f32 scales
//   [KVH, P, S], a scale per stored vector; unscaled formats pass an empty scale array),
//   page_table s32 [B, M], cached s32 [B], new s32 [B], attribute scale -> f32 [B, T, H, D].
//   (A query tile of a longer step passes its own offset in cached and the rest of the row's
//   new tokens in new, which may be negative or more than T: only cached + new counts.)
//
// The numbers of jaxserve.models.attention.gqa_attention_paged: query t of row b sees the
// positions <= cached + t that are below cached + new, every key read back from its page (the
// step's own included, as the format stores it), scores q.k * scale in f32, softmax in f32, a
// row that sees nothing gets zeros. Positions are read in blocks of kBlock with an online
// softmax; each query's sums are its own, in the same blocks and the same order whatever T,
// the batch or how many queries are weighed together, so a position's result does not depend
// on what else the call holds. A page id outside [0, P) is not read: its keys are left out
// (the page tracker fails such a row closed anyway). A block's K and V rows are converted to
// f32 a page's run at a time; with D a multiple of the vector width, its scores are summed W
// positions at once (Isa::ReduceAddEach: the bits of one dot product at a time) and its
// weighted V sums for up to 4 queries at once. Work is shared over (row, KV head, 16-query tile)
// items on XLA's intra-op thread pool.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "aligned.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

extern "C" int jaxserve_native_isa();

namespace {

namespace ffi = xla::ffi;
using jaxserve_native::AlignedVector;

enum Kind { kF32, kBf16, kFp8 };
constexpr int64_t kBlock = 32;  // positions per softmax block (a multiple of every vector width)
constexpr float kNeg = -1e30f;  // as the XLA path: finite, so an empty row stays NaN-free

struct PagedKv {
  const float* q;
  const void* k;
  const void* v;
  const float* k_scale;
  const float* v_scale;
  const int32_t* page_table;
  const int32_t* cached;
  const int32_t* news;
  float* out;
  Kind kind;
  int64_t B, T, H, KVH, G, D, P, S, M;
  float scale;
};

using Floats = AlignedVector<float>;  // cache-line aligned (aligned.h)

// Per-thread buffers of one item: a block of K rows and one of V rows, scores and
// weights per query, and each query's running max, denominator, last correction and weighted sum.
struct Scratch {
  Floats k, v, s, p, acc, m, l, c;
  void Reserve(int64_t Q, int64_t D) {
    auto at_least = [](Floats& x, int64_t n) { if (int64_t(x.size()) < n) x.resize(n); };
    at_least(k, kBlock * D), at_least(v, kBlock * D), at_least(s, Q * kBlock);
    at_least(p, Q * kBlock), at_least(acc, Q * D), at_least(m, Q), at_least(l, Q), at_least(c, Q);
  }
};

// The positions row b's queries read: those below cached + new.
inline int64_t Keys(const PagedKv& kv, int64_t b) { return std::max<int64_t>(0, int64_t(kv.cached[b]) + kv.news[b]); }

inline float Bf16Scalar(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float E4m3Scalar(uint8_t bits) {
  const int e = (bits >> 3) & 15, m = bits & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return bits & 0x80 ? -mag : mag;
}

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
#include "simd512.inc"
#include "attention.inc"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#include "simd256.inc"
#include "attention.inc"
#pragma GCC pop_options
}  // namespace avx2

// Items of (row, KV head, a tile of up to kItemQueries queries): a long step (a prefill chunk)
// over few rows still feeds every thread, and a tile reads only the keys its last query sees.
// A query's sums do not depend on its tile, so the tiles do not change a bit.
constexpr int64_t kItemQueries = 16;

void GqaRun(ffi::ThreadPool& pool, const PagedKv& kv) {
  const bool wide = jaxserve_native_isa() >= 2;
  const int64_t tiles = (kv.T + kItemQueries - 1) / kItemQueries, per_row = kv.KVH * tiles;
  auto item = [&kv, wide, tiles, per_row](int64_t i) {
    thread_local Scratch sc;
    const int64_t b = i / per_row, h = i % per_row / tiles, t0 = i % tiles * kItemQueries;
    const int64_t t1 = std::min(kv.T, t0 + kItemQueries);
    // Queries past the row's new tokens are padding (a prefill step's rows share one length):
    // their outputs are zeros, not computed.
    const int64_t real = std::clamp<int64_t>(kv.news[b], t0, t1);
    for (int64_t t = real; t < t1; ++t)
      std::memset(kv.out + ((b * kv.T + t) * kv.H + h * kv.G) * kv.D, 0, kv.G * kv.D * sizeof(float));
    if (real == t0) return;
    if (wide)
      avx512::GqaItem(kv, b, h, t0, real, sc);
    else
      avx2::GqaItem(kv, b, h, t0, real, sc);
  };
  // Small calls (a decode row over a short context) stay on the calling thread: handing an
  // item to another thread costs more than the item.
  int64_t keys = 0;
  for (int64_t b = 0; b < kv.B; ++b) keys += Keys(kv, b);
  if (keys * kv.KVH * kv.T * kv.G * kv.D < (int64_t(1) << 17)) {
    for (int64_t i = 0; i < kv.B * per_row; ++i) item(i);
  } else {
    jaxserve_native::RunOn run_on(false, kv.B * kv.T >= jaxserve_native::PoolRows());  // a prefill step's queries
    jaxserve_native::ParallelFor(pool, kv.B * per_row, item);
  }
}

bool KindOf(ffi::DataType t, Kind* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = kF32; return true;
    case ffi::DataType::BF16: case ffi::DataType::U16: *kind = kBf16; return true;
    case ffi::DataType::F8E4M3FN: case ffi::DataType::U8: *kind = kFp8; return true;
    default: return false;
  }
}

ffi::Error GqaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> page_table,
                   ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> news, float scale,
                   ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || pd.size() != 2 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("gqa_paged: q [B, T, H, D], pools [KVH, P, S, D], page table [B, M]");
  PagedKv kv{};
  kv.B = qd[0], kv.T = qd[1], kv.H = qd[2], kv.D = qd[3];
  kv.KVH = kd[0], kv.P = kd[1], kv.S = kd[2], kv.M = pd[1];
  for (int i = 0; i < 4; ++i)
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("gqa_paged: k and v pools differ in shape");
  if (kd[3] != kv.D || kv.KVH < 1 || kv.H % kv.KVH || pd[0] != kv.B || int64_t(cached.element_count()) != kv.B ||
      int64_t(news.element_count()) != kv.B || kv.S < 1)
    return ffi::Error::InvalidArgument("gqa_paged: shapes do not agree");
  if (k.element_type() != v.element_type() || !KindOf(k.element_type(), &kv.kind))
    return ffi::Error::InvalidArgument("gqa_paged: pools must both be f32, bf16 (u16) or e4m3fn (u8)");
  const int64_t vectors = kv.KVH * kv.P * kv.S;
  if (kv.kind == kFp8 && (int64_t(k_scale.element_count()) != vectors || int64_t(v_scale.element_count()) != vectors))
    return ffi::Error::InvalidArgument("gqa_paged: e4m3 pools need scales [KVH, P, S]");
  kv.G = kv.H / kv.KVH;
  kv.q = q.typed_data(), kv.k = k.untyped_data(), kv.v = v.untyped_data();
  kv.k_scale = k_scale.typed_data(), kv.v_scale = v_scale.typed_data();
  kv.page_table = page_table.typed_data(), kv.cached = cached.typed_data(), kv.news = news.typed_data();
  kv.out = out->typed_data(), kv.scale = scale;
  GqaRun(pool, kv);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_gqa_paged, GqaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
