// Fused RMSNorm on CUDA: the ops around the kernels of csrc/cuda/rms_norm_kernels.cu (Note
// [kernels apart from torch's headers], parallel_layers/cuda/kernels.h), the math of
// parallel_layers/rms_norm.h as csrc/rms_norm.cpp runs it.
//
// Shapes: x, residual, sum, y, dy, dx are [rows, n] (leading dims flattened); weight, dweight
// [n]; rstd [rows].
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/rms_norm.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cuda {
namespace {

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

template <typename T>
const T* cptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                                       const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1), rows = leading_rows(x);
  const at::Tensor w = rms_kernel_weight(x, weight);
  const at::Tensor x2 = x.contiguous().view({rows, n});
  const at::Tensor r2 = residual.defined() ? residual.contiguous().view({rows, n}) : at::Tensor();
  at::Tensor sum = residual.defined() ? at::empty_like(x2) : at::Tensor();
  at::Tensor y = at::empty({rows, n}, x2.options().dtype(w.scalar_type()));
  at::Tensor rstd = at::empty({rows}, x2.options().dtype(rms_math_dtype(x.scalar_type())));
  if (n == 0) {
    rstd.fill_(rms_rstd<double>(0.0, 0, eps));  // the module's value: mean of nothing is NaN
  } else {
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s_tag, auto w_tag) {
      using S = decltype(s_tag);
      using W = decltype(w_tag);
      launch_rms_norm_forward<S, W>(x2.const_data_ptr<S>(), cptr_or_null<S>(r2),
                                    sum.defined() ? sum.mutable_data_ptr<S>() : nullptr, w.const_data_ptr<W>(),
                                    y.mutable_data_ptr<W>(), rstd.mutable_data_ptr<opmath_t<S>>(), rows, n,
                                    static_cast<opmath_t<S>>(eps), at::cuda::getCurrentCUDAStream());
    });
  }
  const at::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1);
  return {y.view(x.sizes()), sum.defined() ? sum.view(x.sizes()) : sum, rstd.view(lead)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_args(x, weight, std::nullopt, at::kCUDA, "rms_norm");
  auto [y, sum, rstd] = forward(x, at::Tensor(), weight, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_add(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps) {
  check_rms_norm_args(x, weight, residual, at::kCUDA, "rms_norm_add");
  return forward(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& grad_sum) {
  const int64_t n = check_rms_norm_backward_args(grad_y, x, weight, rstd, grad_sum, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = leading_rows(x);
  const at::Tensor w = rms_kernel_weight(x, weight);
  const at::Tensor x2 = x.contiguous().view({rows, n});
  const at::Tensor dy = grad_y.contiguous().view({rows, n});
  const at::Tensor dsum = grad_sum ? grad_sum->contiguous().view({rows, n}) : at::Tensor();
  const at::Tensor rs = rstd.contiguous().view({rows});
  at::Tensor dx = at::empty_like(x2);
  // Up to 1024 chunks, a partials buffer of at most 1024 rows (float; double for float64). The
  // register kernel takes chunks of >= 4 rows: a few blocks per SM from ~1000 rows on, what hides
  // the latency of each row's loads. Wider rows keep the >= 8 their loop kernel was measured with
  // (Note [rms_norm backward in registers]).
  const int64_t min_rows = n <= kRmsNormRegisterWidth ? 4 : 8;
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/1024, min_rows);
  const at::ScalarType m = rms_math_dtype(x.scalar_type());
  // every element written by the kernel (its chunk's first row starts the partial): no memset
  at::Tensor partials = at::empty({chunks.num_chunks(), n}, x2.options().dtype(m));
  dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s_tag, auto w_tag) {
    using S = decltype(s_tag);
    using W = decltype(w_tag);
    launch_rms_norm_backward<S, W>(dy.const_data_ptr<W>(), x2.const_data_ptr<S>(), w.const_data_ptr<W>(),
                                   rs.const_data_ptr<opmath_t<S>>(), cptr_or_null<S>(dsum), dx.mutable_data_ptr<S>(),
                                   partials.mutable_data_ptr<opmath_t<S>>(), chunks, n,
                                   at::cuda::getCurrentCUDAStream());
  });
  return {dx.view(x.sizes()), partials.sum(0).to(weight.scalar_type())};
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("rms_norm", &parallel_layers::cuda::rms_norm);
  m.impl("rms_norm_add", &parallel_layers::cuda::rms_norm_add);
  m.impl("rms_norm_backward", &parallel_layers::cuda::rms_norm_backward);
}
