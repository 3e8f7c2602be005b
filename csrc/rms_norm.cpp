// Fused RMSNorm on CPU (math in parallel_layers/rms_norm.h): forward, forward of x + residual,
// and backward (dx and the weight gradient in one pass over the data).
//
// Shapes: x, residual, sum, y, dy, dx are [rows, n] (leading dims flattened); weight, dweight
// [n]; rstd [rows]. Each row is two passes over n elements that stay in L1/L2: the sum of squares
// (backward: of g * h~), then the elementwise part. Rows run in parallel (at::parallel_for).
//
// The row loops are written once as always-inline templates and compiled for several x86
// instruction sets (target_clones, as csrc/gelu_epilogue.cpp does) rather than with at::vec:
// in an extension at::vec::Vectorized is the generic, baseline-ISA version (ATen compiles its
// AVX2 / AVX-512 variants only for its own kernels), while a clone gets 512-bit lanes here.
// bfloat16 travels as raw bits and converts inside the loop; float16 as the compiler's _Float16
// where it has one (GCC >= 12 on x86: F16C conversions in the clones that have them), else
// through float32 row buffers (c10::Half's conversions do not vectorise: one thread, 4096 x
// 1024, 22 ms against the module's 8); float64 runs the same templates.
//
// Accumulation: the sum of squares and the backward's sum of g * h~ accumulate in float64 for
// float32 (and float64) rows, so that float32's variance is the correctly rounded one, which
// the Hugging Face module's float32 cascade sum also gets nearly always; bfloat16 rows
// accumulate in float32 across the vector lanes (h is rounded to 8 bits anyway), float16 rows
// in float64 (11 bits: float32 sums had put ~6e-4 of elements an ulp off the module's). The
// weight gradient sums dy * h per chunk of rows (parallel_layers/row_chunks.h; the chunking
// depends on the shape only) into float32 (float64) partials, which are then added in chunk
// order: the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/rms_norm.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cpu {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PL_RMS_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#define PL_RMS_INLINE inline __attribute__((always_inline))
#else
#define PL_RMS_CLONES
#define PL_RMS_INLINE inline
#endif

#if defined(__FLT16_MAX__)
constexpr bool kFloat16Loops = true;  // float16 runs the vectorised loops as _Float16
#else
constexpr bool kFloat16Loops = false;
#endif

// Storage <-> math type inside the loops; bfloat16 as its raw bits (uint16_t). Narrowing rounds
// to nearest even and maps NaN to the canonical quiet NaN: the bits of c10::BFloat16(float).
PL_RMS_INLINE float widen(float v) { return v; }
PL_RMS_INLINE double widen(double v) { return v; }
#if defined(__FLT16_MAX__)
PL_RMS_INLINE float widen(_Float16 v) { return static_cast<float>(v); }
#endif
PL_RMS_INLINE float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <typename S, typename T>
PL_RMS_INLINE S narrow(T v) {
  if constexpr (!std::is_same_v<S, uint16_t>) {
    return static_cast<S>(v);
  } else {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

// S: x's storage (float, double, uint16_t for bfloat16); W: weight and output storage (S, or
// float for a 16-bit x); M: math type; Acc: accumulator of the row sums.
template <typename S>
using math_t = std::conditional_t<std::is_same_v<S, double>, double, float>;
template <typename S>
using acc_t = std::conditional_t<std::is_same_v<S, uint16_t>, float, double>;

// v^2 in the accumulator type. A 16-bit value's square is exact in float32; squaring there also
// keeps GCC from folding _Float16 -> float -> double into a libgcc call (__extendhfdf2) per element.
template <typename S>
PL_RMS_INLINE acc_t<S> square(math_t<S> v) {
  if constexpr (sizeof(S) == 2) {
    return static_cast<acc_t<S>>(v * v);
  } else {
    return static_cast<acc_t<S>>(v) * static_cast<acc_t<S>>(v);
  }
}

// One row of the forward: sum = x + res (when res), y = weight * round(v * rstd) of v = sum or x.
// Returns rstd.
template <typename S, typename W>
PL_RMS_INLINE math_t<S> forward_row(const S* x, const S* res, S* sum, const W* w, W* y, int64_t n,
                                    math_t<S> eps) {
  using M = math_t<S>;
  acc_t<S> sum_sq = 0;
  if (res != nullptr) {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) {
      const S s = narrow<S>(widen(x[i]) + widen(res[i]));
      sum[i] = s;
      sum_sq += square<S>(widen(s));
    }
    x = sum;
  } else {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) sum_sq += square<S>(widen(x[i]));
  }
  const M rstd = rms_rstd<M>(sum_sq, n, eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const M h = widen(narrow<S>(widen(x[i]) * rstd));
    y[i] = narrow<W>(widen(w[i]) * h);
  }
  return rstd;
}

// The elementwise pass of the backward: dx (+ dsum when kAddSum), dw_acc += dy * h. The dsum
// test is a template parameter, not a branch in the loop: GCC did not unswitch it for
// bfloat16, and a load from a maybe-null pointer cannot be vectorised (1 thread, 4096 x 1024:
// 8.5 ms against 2.8 for float32).
template <bool kAddSum, typename S, typename W>
PL_RMS_INLINE void backward_elementwise(const W* dy, const S* x, const W* w, math_t<S> rstd, math_t<S> mean_gh,
                                        const S* dsum, S* dx, math_t<S>* dw_acc, int64_t n) {
  using M = math_t<S>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const M h = widen(x[i]) * rstd;
    M d = rms_dx<M>(widen(dy[i]) * widen(w[i]), h, rstd, mean_gh);
    if constexpr (kAddSum) d += widen(dsum[i]);
    dx[i] = narrow<S>(d);
    dw_acc[i] += widen(dy[i]) * widen(narrow<S>(h));
  }
}

// One row of the backward: dx (+ dsum), and dw_acc += dy * h.
template <typename S, typename W>
PL_RMS_INLINE void backward_row(const W* dy, const S* x, const W* w, math_t<S> rstd, const S* dsum, S* dx,
                                math_t<S>* dw_acc, int64_t n) {
  using M = math_t<S>;
  acc_t<S> dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) {
    const M g = widen(dy[i]) * widen(w[i]);
    dot += static_cast<acc_t<S>>(g * (widen(x[i]) * rstd));
  }
  const M mean_gh = static_cast<M>(dot / static_cast<acc_t<S>>(n));
  if (dsum != nullptr) {
    backward_elementwise<true>(dy, x, w, rstd, mean_gh, dsum, dx, dw_acc, n);
  } else {
    backward_elementwise<false>(dy, x, w, rstd, mean_gh, dsum, dx, dw_acc, n);
  }
}

// The instruction-set clones, one per (x, weight) storage pair.
#define PL_RMS_ROW_FUNCTIONS(S, W, suffix)                                                                     \
  PL_RMS_CLONES math_t<S> forward_##suffix(const S* x, const S* res, S* sum, const W* w, W* y, int64_t n,     \
                                           math_t<S> eps) {                                                   \
    return forward_row<S, W>(x, res, sum, w, y, n, eps);                                                      \
  }                                                                                                           \
  PL_RMS_CLONES void backward_##suffix(const W* dy, const S* x, const W* w, math_t<S> rstd, const S* dsum,    \
                                       S* dx, math_t<S>* dw_acc, int64_t n) {                                 \
    backward_row<S, W>(dy, x, w, rstd, dsum, dx, dw_acc, n);                                                  \
  }
PL_RMS_ROW_FUNCTIONS(float, float, f32)
PL_RMS_ROW_FUNCTIONS(double, double, f64)
PL_RMS_ROW_FUNCTIONS(uint16_t, uint16_t, bf16)
PL_RMS_ROW_FUNCTIONS(uint16_t, float, bf16_f32)
#if defined(__FLT16_MAX__)
PL_RMS_ROW_FUNCTIONS(_Float16, _Float16, f16)
PL_RMS_ROW_FUNCTIONS(_Float16, float, f16_f32)
#endif
#undef PL_RMS_ROW_FUNCTIONS

PL_RMS_INLINE math_t<float> forward_any(const float* x, const float* r, float* s, const float* w, float* y,
                                        int64_t n, float eps) {
  return forward_f32(x, r, s, w, y, n, eps);
}
PL_RMS_INLINE double forward_any(const double* x, const double* r, double* s, const double* w, double* y,
                                 int64_t n, double eps) {
  return forward_f64(x, r, s, w, y, n, eps);
}
PL_RMS_INLINE float forward_any(const uint16_t* x, const uint16_t* r, uint16_t* s, const uint16_t* w, uint16_t* y,
                                int64_t n, float eps) {
  return forward_bf16(x, r, s, w, y, n, eps);
}
PL_RMS_INLINE float forward_any(const uint16_t* x, const uint16_t* r, uint16_t* s, const float* w, float* y,
                                int64_t n, float eps) {
  return forward_bf16_f32(x, r, s, w, y, n, eps);
}
#if defined(__FLT16_MAX__)
PL_RMS_INLINE float forward_any(const _Float16* x, const _Float16* r, _Float16* s, const _Float16* w, _Float16* y,
                                int64_t n, float eps) {
  return forward_f16(x, r, s, w, y, n, eps);
}
PL_RMS_INLINE float forward_any(const _Float16* x, const _Float16* r, _Float16* s, const float* w, float* y,
                                int64_t n, float eps) {
  return forward_f16_f32(x, r, s, w, y, n, eps);
}
PL_RMS_INLINE void backward_any(const _Float16* dy, const _Float16* x, const _Float16* w, float rstd,
                                const _Float16* dsum, _Float16* dx, float* acc, int64_t n) {
  backward_f16(dy, x, w, rstd, dsum, dx, acc, n);
}
PL_RMS_INLINE void backward_any(const float* dy, const _Float16* x, const float* w, float rstd, const _Float16* dsum,
                                _Float16* dx, float* acc, int64_t n) {
  backward_f16_f32(dy, x, w, rstd, dsum, dx, acc, n);
}
#endif
PL_RMS_INLINE void backward_any(const float* dy, const float* x, const float* w, float rstd, const float* dsum,
                                float* dx, float* acc, int64_t n) {
  backward_f32(dy, x, w, rstd, dsum, dx, acc, n);
}
PL_RMS_INLINE void backward_any(const double* dy, const double* x, const double* w, double rstd, const double* dsum,
                                double* dx, double* acc, int64_t n) {
  backward_f64(dy, x, w, rstd, dsum, dx, acc, n);
}
PL_RMS_INLINE void backward_any(const uint16_t* dy, const uint16_t* x, const uint16_t* w, float rstd,
                                const uint16_t* dsum, uint16_t* dx, float* acc, int64_t n) {
  backward_bf16(dy, x, w, rstd, dsum, dx, acc, n);
}
PL_RMS_INLINE void backward_any(const float* dy, const uint16_t* x, const float* w, float rstd, const uint16_t* dsum,
                                uint16_t* dx, float* acc, int64_t n) {
  backward_bf16_f32(dy, x, w, rstd, dsum, dx, acc, n);
}

// The pointer the loops take: bfloat16 as raw bits, float16 as _Float16 (the same IEEE binary16
// bits as c10::Half), float and double as they are.
template <typename T>
auto loop_ptr(T* p) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, at::BFloat16>) {
    using U = std::conditional_t<std::is_const_v<T>, const uint16_t, uint16_t>;
    return reinterpret_cast<U*>(p);
#if defined(__FLT16_MAX__)
  } else if constexpr (std::is_same_v<std::remove_const_t<T>, at::Half>) {
    using U = std::conditional_t<std::is_const_v<T>, const _Float16, _Float16>;
    return reinterpret_cast<U*>(p);
#endif
  } else {
    return p;
  }
}

template <typename T>
const T* cptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// Rows per task: ~64K elements, enough work to amortise scheduling, small enough for L2.
int64_t min_rows_per_task(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)); }

// Calls fn with a (scalar_t, weight_t) pair of C++ types for x's dtype and the kernel weight's.
template <typename Fn>
void dispatch_rms(at::ScalarType x, at::ScalarType w, Fn&& fn) {
  switch (x) {
    case at::kFloat: return fn(float{}, float{});
    case at::kDouble: return fn(double{}, double{});
    case at::kBFloat16: return w == at::kFloat ? fn(at::BFloat16{}, float{}) : fn(at::BFloat16{}, at::BFloat16{});
    case at::kHalf: return w == at::kFloat ? fn(at::Half{}, float{}) : fn(at::Half{}, at::Half{});
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x);
  }
}

// float16 rows without _Float16, through float32 row buffers; the float32 result rounds once to
// float16 where the math says so (h, and y / dx). Unused where the compiler has _Float16.
[[maybe_unused]] void forward_rows_half(const at::Half* x, const at::Half* res, at::Half* sum, const void* w,
                                        bool w_float, void* y, float* rstd, int64_t rows, int64_t n, float eps) {
  std::vector<float> v(n), w32(n);
  if (w_float) {
    std::copy_n(static_cast<const float*>(w), n, w32.data());
  } else {
    std::copy_n(static_cast<const at::Half*>(w), n, w32.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const at::Half* xr = x + r * n;
    double sum_sq = 0;  // a scalar loop: float64 costs nothing here and keeps the sum exact-ish
    for (int64_t i = 0; i < n; ++i) {
      const at::Half s = res ? at::Half(float(xr[i]) + float(res[r * n + i])) : xr[i];
      if (res) sum[r * n + i] = s;
      v[i] = s;
      sum_sq += double(v[i]) * v[i];
    }
    rstd[r] = rms_rstd<float>(sum_sq, n, eps);
    for (int64_t i = 0; i < n; ++i) v[i] = w32[i] * float(at::Half(v[i] * rstd[r]));
    if (w_float) {
      std::copy_n(v.data(), n, static_cast<float*>(y) + r * n);
    } else {
      std::copy_n(v.data(), n, static_cast<at::Half*>(y) + r * n);
    }
  }
}

template <typename scalar_t, typename weight_t>
void forward_rows(const at::Tensor& x, const at::Tensor& res, const at::Tensor& sum, const at::Tensor& w,
                  const at::Tensor& y, const at::Tensor& rstd, int64_t begin, int64_t end, double eps) {
  using M = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t n = x.size(1);
  M* rs = rstd.mutable_data_ptr<M>();
  if constexpr (std::is_same_v<scalar_t, at::Half> && !kFloat16Loops) {
    const at::Half* r = res.defined() ? res.const_data_ptr<at::Half>() + begin * n : nullptr;
    at::Half* s = sum.defined() ? sum.mutable_data_ptr<at::Half>() + begin * n : nullptr;
    forward_rows_half(x.const_data_ptr<at::Half>() + begin * n, r, s, w.const_data_ptr(),
                      std::is_same_v<weight_t, float>, static_cast<weight_t*>(y.mutable_data_ptr()) + begin * n,
                      rs + begin, end - begin, n, static_cast<float>(eps));
  } else {
    const auto* xp = loop_ptr(x.const_data_ptr<scalar_t>());
    const auto* rp = loop_ptr(cptr_or_null<scalar_t>(res));
    auto* sp = sum.defined() ? loop_ptr(sum.mutable_data_ptr<scalar_t>()) : nullptr;
    const auto* wp = loop_ptr(w.const_data_ptr<weight_t>());
    auto* yp = loop_ptr(y.mutable_data_ptr<weight_t>());
    for (int64_t r = begin; r < end; ++r) {
      rs[r] = forward_any(xp + r * n, rp ? rp + r * n : nullptr, sp ? sp + r * n : nullptr, wp, yp + r * n, n,
                          static_cast<M>(eps));
    }
  }
}

// float16 rows of the backward without _Float16, through float32 row buffers.
[[maybe_unused]] void backward_rows_half(const void* dy, bool w_float, const at::Half* x, const float* w32,
                                         const float* rstd, const at::Half* dsum, at::Half* dx, float* acc,
                                         int64_t begin, int64_t end, int64_t n) {
  std::vector<float> g(n), dy32(n);
  for (int64_t r = begin; r < end; ++r) {
    if (w_float) {
      std::copy_n(static_cast<const float*>(dy) + r * n, n, dy32.data());
    } else {
      std::copy_n(static_cast<const at::Half*>(dy) + r * n, n, dy32.data());
    }
    const at::Half* xr = x + r * n;
    double dot = 0;
    for (int64_t i = 0; i < n; ++i) {
      g[i] = dy32[i] * w32[i];
      dot += g[i] * (float(xr[i]) * rstd[r]);
    }
    const float mean_gh = static_cast<float>(dot / static_cast<double>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float h = float(xr[i]) * rstd[r];
      const float d = rms_dx<float>(g[i], h, rstd[r], mean_gh);
      dx[r * n + i] = at::Half(dsum ? d + float(dsum[r * n + i]) : d);
      acc[i] += dy32[i] * float(at::Half(h));
    }
  }
}

template <typename scalar_t, typename weight_t>
void backward_rows(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& w32,
                   const at::Tensor& rstd, const at::Tensor& dsum, const at::Tensor& dx, const at::Tensor& partial,
                   int64_t begin, int64_t end) {
  using M = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t n = x.size(1);
  const M* rs = rstd.const_data_ptr<M>();
  M* acc = partial.mutable_data_ptr<M>();
  if constexpr (std::is_same_v<scalar_t, at::Half> && !kFloat16Loops) {
    backward_rows_half(dy.const_data_ptr(), std::is_same_v<weight_t, float>, x.const_data_ptr<at::Half>(),
                       w32.const_data_ptr<float>(), rs, cptr_or_null<at::Half>(dsum),
                       dx.mutable_data_ptr<at::Half>(), acc, begin, end, n);
  } else {
    const auto* dyp = loop_ptr(dy.const_data_ptr<weight_t>());
    const auto* xp = loop_ptr(x.const_data_ptr<scalar_t>());
    const auto* wp = loop_ptr(w.const_data_ptr<weight_t>());
    const auto* dsp = loop_ptr(cptr_or_null<scalar_t>(dsum));
    auto* dxp = loop_ptr(dx.mutable_data_ptr<scalar_t>());
    for (int64_t r = begin; r < end; ++r) {
      backward_any(dyp + r * n, xp + r * n, wp, rs[r], dsp ? dsp + r * n : nullptr, dxp + r * n, acc, n);
    }
  }
}

// The forward of both ops; residual undefined for rms_norm. Returns (y, sum, rstd), sum undefined
// without a residual.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                                       const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = leading_rows(x);
  const at::Tensor w = rms_kernel_weight(x, weight);
  const at::Tensor x2 = x.contiguous().view({rows, n});
  const at::Tensor r2 = residual.defined() ? residual.contiguous().view({rows, n}) : at::Tensor();
  at::Tensor sum = residual.defined() ? at::empty_like(x2) : at::Tensor();
  at::Tensor y = at::empty({rows, n}, x2.options().dtype(w.scalar_type()));
  at::Tensor rstd = at::empty({rows}, x2.options().dtype(rms_math_dtype(x.scalar_type())));
  if (n > 0) {
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s, auto wt) {
      at::parallel_for(0, rows, min_rows_per_task(n), [&](int64_t begin, int64_t end) {
        forward_rows<decltype(s), decltype(wt)>(x2, r2, sum, w, y, rstd, begin, end, eps);
      });
    });
  } else {
    rstd.fill_(rms_rstd<double>(0.0, 0, eps));  // the module's value: mean of nothing is NaN
  }
  const at::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1);
  return {y.view(x.sizes()), sum.defined() ? sum.view(x.sizes()) : sum, rstd.view(lead)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_args(x, weight, std::nullopt, at::kCPU, "rms_norm");
  auto [y, sum, rstd] = forward(x, at::Tensor(), weight, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_add(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps) {
  check_rms_norm_args(x, weight, residual, at::kCPU, "rms_norm_add");
  return forward(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& grad_sum) {
  const int64_t n = check_rms_norm_backward_args(grad_y, x, weight, rstd, grad_sum, at::kCPU);
  const int64_t rows = leading_rows(x);
  const at::Tensor w = rms_kernel_weight(x, weight);
  const at::Tensor x2 = x.contiguous().view({rows, n});
  const at::Tensor dy = grad_y.contiguous().view({rows, n});
  const at::Tensor dsum = grad_sum ? grad_sum->contiguous().view({rows, n}) : at::Tensor();
  const at::Tensor rs = rstd.contiguous().view({rows});
  at::Tensor dx = at::empty_like(x2);
  // The chunking depends on the shape only (no thread count), so dweight's summation order does too.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, min_rows_per_task(n));
  const at::ScalarType m = rms_math_dtype(x.scalar_type());
  at::Tensor partials = at::zeros({chunks.num_chunks(), n}, x2.options().dtype(m));
  const bool buffered = x.scalar_type() == at::kHalf && !kFloat16Loops;
  const at::Tensor w32 = buffered ? w.to(at::kFloat) : at::Tensor();  // the row buffers' weight
  if (n > 0 && rows > 0) {
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s, auto wt) {
      at::parallel_for(0, chunks.num_chunks(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          backward_rows<decltype(s), decltype(wt)>(dy, x2, w, w32, rs, dsum, dx, partials[c], chunks.begin(c),
                                                   chunks.end(c));
        }
      });
    });
  }
  // The partials added in chunk order, one column block per task.
  at::Tensor dweight = at::zeros({n}, x2.options().dtype(m));
  AT_DISPATCH_FLOATING_TYPES(m, "rms_norm_dweight", [&] {
    const scalar_t* p = partials.const_data_ptr<scalar_t>();
    scalar_t* out = dweight.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t c = 0; c < chunks.num_chunks(); ++c) {
        for (int64_t i = begin; i < end; ++i) out[i] += p[c * n + i];
      }
    });
  });
  return {dx.view(x.sizes()), dweight.to(weight.scalar_type())};
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("rms_norm", &parallel_layers::cpu::rms_norm);
  m.impl("rms_norm_add", &parallel_layers::cpu::rms_norm_add);
  m.impl("rms_norm_backward", &parallel_layers::cpu::rms_norm_backward);
}
