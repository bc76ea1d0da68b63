// The XLA FFI handlers of jaxserve's native matmul kernels (registered for the CPU platform by
// jaxserve.native): the dense form, one stored weight [K, N]; the grouped-by-expert form (the
// ragged MoE matmul), stacked weights [E, K, N] and rows sorted by expert; and the exact s8 x s8
// -> s32 entry. Each checks its operands' shapes against the format's layout, then runs rows.h.
#include <algorithm>
#include <cstdint>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;
using namespace jaxserve_native;

bool Int4Layout(int64_t Kp, int64_t N, int64_t wk, int64_t sk, int64_t sn, int64_t group) {
  return group >= 4 && group % 4 == 0 && Kp % group == 0 && wk * 2 == Kp && sk == Kp / group && sn == N;
}

bool Fp8Blocks(int64_t K, int64_t N, int64_t sk, int64_t sn, int64_t bk, int64_t bn) {
  return bk >= 1 && bn >= 1 && (bn == 1 || bn % 16 == 0) && sk == (K + bk - 1) / bk && sn == (N + bn - 1) / bn;
}

bool Fp8Type(const ffi::AnyBuffer& w) {
  return w.element_type() == ffi::DataType::F8E4M3FN || w.element_type() == ffi::DataType::U8;
}


ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::F32> s, int64_t group, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2) return ffi::Error::InvalidArgument("int4: operands must be 2-D");
  if (!Int4Layout(xd[1], wd[1], wd[0], sd[0], sd[1], group))
    return ffi::Error::InvalidArgument("int4: shapes do not match the group layout (a group of 4k values)");
  Int4Rows(pool, x.typed_data(), xd[0], xd[1], w.typed_data(), wd[1], s.typed_data(), group, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1] || sd.size() != 2 || sd[0] != 1 || sd[1] != wd[1])
    return ffi::Error::InvalidArgument("int8: x [M, K], w [K, N], scales [1, N] expected");
  Int8Rows(pool, x.typed_data(), xd[0], xd[1], w.typed_data(), wd[1], s.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

// w: the e4m3fn array itself (no bitcast in the program: XLA:CPU would copy the weight) or its
// bits as uint8.
ffi::Error Fp8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                   ffi::Buffer<ffi::F32> s, int64_t bk, int64_t bn, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1] || sd.size() != 2)
    return ffi::Error::InvalidArgument("fp8: x [M, K], w [K, N] expected");
  if (!Fp8Type(w)) return ffi::Error::InvalidArgument("fp8: w must be float8_e4m3fn or its uint8 bits");
  if (!Fp8Blocks(xd[1], wd[1], sd[0], sd[1], bk, bn))
    return ffi::Error::InvalidArgument("fp8: scales do not match the scale block");
  Fp8Rows(pool, x.typed_data(), xd[0], xd[1], static_cast<const uint8_t*>(w.untyped_data()), wd[1], s.typed_data(),
          bk, bn, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Bf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1]) return ffi::Error::InvalidArgument("bf16: bad shapes");
  Bf16Rows(pool, x.typed_data(), xd[0], xd[1], reinterpret_cast<const uint16_t*>(w.untyped_data()), wd[1],
           y->typed_data());
  return ffi::Error::Success();
}

ffi::Error ExactImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                     ffi::ResultBuffer<ffi::S32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1]) return ffi::Error::InvalidArgument("w8a8: bad shapes");
  ExactRows(pool, x.typed_data(), xd[0], xd[1], w.typed_data(), wd[1], y->typed_data());
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ grouped by expert
// x [M, K] rows sorted by expert, w [E, ...] the format's stored weight per expert, sizes int32
// [E]: rows [off_e, off_e + sizes[e]) times expert e. Each expert that has rows runs as one dense
// call on its rows and its own weight bytes; an expert without rows is not read. Rows past
// sum(sizes) come out as zeros (lax.ragged_dot's rule); negative sizes count as 0, and sizes
// past M are cut at M.
template <class Run>
void ForExperts(const int32_t* sizes, int64_t E, int64_t M, int64_t N, float* y, Run run) {
  int64_t off = 0;
  for (int64_t e = 0; e < E && off < M; ++e) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(sizes[e], 0), M - off);
    if (rows) run(e, off, rows);
    off += rows;
  }
  std::fill(y + off * N, y + M * N, 0.0f);
}

ffi::Error Int4GroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::S32> sizes, int64_t group,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions(), gd = sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || gd.size() != 1 || sd[0] != wd[0] || gd[0] != wd[0])
    return ffi::Error::InvalidArgument("int4 grouped: x [M, Kp], w [E, Kp/2, N], scales [E, Kp/G, N], sizes [E]");
  const int64_t Kp = xd[1], N = wd[2];
  if (!Int4Layout(Kp, N, wd[1], sd[1], sd[2], group))
    return ffi::Error::InvalidArgument("int4 grouped: shapes do not match the group layout (a group of 4k values)");
  ForExperts(sizes.typed_data(), wd[0], xd[0], N, y->typed_data(), [&](int64_t e, int64_t off, int64_t rows) {
    Int4Rows(pool, x.typed_data() + off * Kp, rows, Kp, w.typed_data() + e * wd[1] * N, N,
             s.typed_data() + e * sd[1] * N, group, y->typed_data() + off * N);
  });
  return ffi::Error::Success();
}

ffi::Error Int8GroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                           ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions(), gd = sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || sd.size() != 3 || sd[0] != wd[0] || sd[1] != 1 ||
      sd[2] != wd[2] || gd.size() != 1 || gd[0] != wd[0])
    return ffi::Error::InvalidArgument("int8 grouped: x [M, K], w [E, K, N], scales [E, 1, N], sizes [E]");
  const int64_t K = xd[1], N = wd[2];
  ForExperts(sizes.typed_data(), wd[0], xd[0], N, y->typed_data(), [&](int64_t e, int64_t off, int64_t rows) {
    Int8Rows(pool, x.typed_data() + off * K, rows, K, w.typed_data() + e * K * N, N, s.typed_data() + e * N,
             y->typed_data() + off * N);
  });
  return ffi::Error::Success();
}

ffi::Error Fp8GroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> s,
                          ffi::Buffer<ffi::S32> sizes, int64_t bk, int64_t bn, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = s.dimensions(), gd = sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || sd.size() != 3 || sd[0] != wd[0] || gd.size() != 1 ||
      gd[0] != wd[0])
    return ffi::Error::InvalidArgument("fp8 grouped: x [M, K], w [E, K, N], scales [E, ., .], sizes [E]");
  if (!Fp8Type(w)) return ffi::Error::InvalidArgument("fp8 grouped: w must be float8_e4m3fn or its uint8 bits");
  const int64_t K = xd[1], N = wd[2];
  if (!Fp8Blocks(K, N, sd[1], sd[2], bk, bn))
    return ffi::Error::InvalidArgument("fp8 grouped: scales do not match the scale block");
  const auto* bits = static_cast<const uint8_t*>(w.untyped_data());
  ForExperts(sizes.typed_data(), wd[0], xd[0], N, y->typed_data(), [&](int64_t e, int64_t off, int64_t rows) {
    Fp8Rows(pool, x.typed_data() + off * K, rows, K, bits + e * K * N, N, s.typed_data() + e * sd[1] * sd[2], bk, bn,
            y->typed_data() + off * N);
  });
  return ffi::Error::Success();
}

// Unscaled weights, the grouped form: Plain names the stored element type (T, FFI type D), the
// dense kernel (Rows) and the error prefix.
struct PlainBf16 {
  using T = uint16_t;  // bf16 bits
  static constexpr ffi::DataType D = ffi::DataType::BF16;
  static constexpr const char* kShapes = "bf16 grouped: x [M, K], w [E, K, N], sizes [E]";
  static void Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y) {
    Bf16Rows(pool, x, M, K, w, N, y);
  }
};
struct PlainF32 {
  using T = float;
  static constexpr ffi::DataType D = ffi::DataType::F32;
  static constexpr const char* kShapes = "f32 grouped: x [M, K], w [E, K, N], sizes [E]";
  static void Rows(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y) {
    F32Rows(pool, x, M, K, w, N, y);
  }
};

template <class Plain>
ffi::Error PlainGroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<Plain::D> w,
                            ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), gd = sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || gd.size() != 1 || gd[0] != wd[0])
    return ffi::Error::InvalidArgument(Plain::kShapes);
  const int64_t K = xd[1], N = wd[2];
  const auto* data = reinterpret_cast<const typename Plain::T*>(w.untyped_data());
  ForExperts(sizes.typed_data(), wd[0], xd[0], N, y->typed_data(), [&](int64_t e, int64_t off, int64_t rows) {
    Plain::Rows(pool, x.typed_data() + off * K, rows, K, data + e * K * N, N, y->typed_data() + off * N);
  });
  return ffi::Error::Success();
}

template <class Plain>
auto PlainGroupedBinding() {
  return ffi::Ffi::Bind()
      .template Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<Plain::D>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_int4_w4a16, Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_int8_w8a16, Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_fp8_w8a16, Fp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bk")
                                  .Attr<int64_t>("bn")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_bf16_w16a32, Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_w8a8_s32, ExactImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());


XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_int4_grouped, Int4GroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("group")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_int8_grouped, Int8GroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_fp8_grouped, Fp8GroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bk")
                                  .Attr<int64_t>("bn")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_bf16_grouped, PlainGroupedImpl<PlainBf16>, PlainGroupedBinding<PlainBf16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_f32_grouped, PlainGroupedImpl<PlainF32>, PlainGroupedBinding<PlainF32>());
