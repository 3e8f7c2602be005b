// Fused linear + SwiGLU on CUDA: the ops around the epilogue kernels of
// csrc/cuda/linear_swiglu_kernels.cu (Note [kernels apart from torch's headers],
// parallel_layers/cuda/kernels.h), with the same math (parallel_layers/swiglu.h), packed layout
// (PackedGateUp) and bias-gradient row chunks (parallel_layers/row_chunks.h) as the CPU op
// (csrc/linear_swiglu.cpp).
//
// Shapes: x [M, K] (leading dims flattened), weight [2N, K] (gate rows on up rows), bias [2N],
// pre-activation z [M, 2N] (gate | up in each row), y [M, N].
//
// Forward: the packed GEMM through ATen's addmm / mm - cuBLASLt with its bias epilogue where it
// applies, every status checked by ATen - then our SwiGLU kernel over z. cuBLASLt has no
// epilogue that combines two column ranges of its output, so calling it directly here would
// add descriptors to maintain and nothing else. Backward: our kernel writes d_gate | d_up and
// the bias gradient's per-chunk partial sums in one pass over z and grad_y, then the GEMMs that
// are needed, the weight gradient's through the shared weight_grad.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/ops.h"

namespace parallel_layers::cuda {
namespace {

// d_preact = d_gate | d_up [rows, 2n] and, when need_dbias, dbias [2n] (else an undefined
// tensor) from dy [rows, n] and z [rows, 2n], both contiguous: one pass of the backward kernel.
std::tuple<at::Tensor, at::Tensor> dswiglu(const at::Tensor& dy, const at::Tensor& z, bool need_dbias) {
  const int64_t rows = z.size(0), n = z.size(1) / 2;
  at::Tensor dz = at::empty({rows, 2 * n}, z.options());
  // Chunks as bias_gelu_backward's. The partial sums only when the bias gradient is asked for;
  // the kernel skips them when null.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, /*min_rows=*/32);
  at::Tensor partials;
  if (need_dbias) {
    partials = at::empty({chunks.num_chunks(), 2 * n}, z.options().dtype(at::toOpMathType(z.scalar_type())));
    if (rows == 0 || n == 0) partials.zero_();  // the kernel writes every partial of a non-empty z
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "swiglu_backward_cuda", [&] {
    launch_swiglu_backward<scalar_t>(dy.const_data_ptr<scalar_t>(), z.const_data_ptr<scalar_t>(),
                                     dz.mutable_data_ptr<scalar_t>(),
                                     need_dbias ? partials.mutable_data_ptr<opmath_t<scalar_t>>() : nullptr, chunks,
                                     n, at::cuda::getCurrentCUDAStream());
  });
  return {dz, need_dbias ? partials.sum(0).to(z.scalar_type()) : at::Tensor()};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_swiglu(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias, bool save_preact) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N2] = check_linear_swiglu_args(x, weight, bias, at::kCUDA);
  const int64_t N = N2 / 2;
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end()), pre_shape = out_shape;
  out_shape.back() = N;
  pre_shape.back() = N2;
  const auto no_preact = [&] { return at::empty({0}, x.options()); };
  if (M == 0 || N == 0) {
    return {at::empty(out_shape, x.options()), save_preact ? at::empty(pre_shape, x.options()) : no_preact()};
  }
  // The bias inside the GEMM: addmm rounds acc + bias once to the dtype, as F.linear does.
  const at::Tensor x2 = x.reshape({M, K});
  const at::Tensor z = bias ? at::addmm(*bias, x2, weight.t()) : at::mm(x2, weight.t());  // [M, 2N], contiguous
  at::Tensor y = at::empty({M, N}, x.options());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "linear_swiglu_cuda", [&] {
    launch_swiglu_forward<scalar_t>(z.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), M, N, sms,
                                    at::cuda::getCurrentCUDAStream());
  });
  return {y.view(out_shape), save_preact ? z.view(pre_shape) : no_preact()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                      const at::Tensor& weight,
                                                                      const at::Tensor& preact,
                                                                      std::array<bool, 3> output_mask) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N2] = check_linear_swiglu_backward_args(grad_y, x, weight, preact, at::kCUDA);
  const int64_t N = N2 / 2;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [need_dx, need_dw, need_db] = output_mask;
  // Unasked gradients: distinct empty tensors (outputs must not alias).
  const auto empty = [&] { return at::empty({0}, x.options()); };
  if (!need_dx && !need_dw && !need_db) return {empty(), empty(), empty()};
  const at::Tensor dy = grad_y.reshape({M, N}).contiguous();
  const at::Tensor z = preact.reshape({M, N2}).contiguous();
  auto [dz, db_or_none] = dswiglu(dy, z, need_db);
  at::Tensor db = need_db ? db_or_none : empty();
  at::Tensor dx = need_dx ? at::mm(dz, weight).view(x.sizes()) : empty();
  at::Tensor dw = need_dw ? weight_grad(dz, at::Tensor(), x.reshape({M, K})) : empty();
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& preact,
                                                   bool need_dbias) {
  const int64_t n = check_swiglu_backward_args(grad_y, preact, at::kCUDA);
  const c10::cuda::CUDAGuard guard(preact.device());
  const int64_t rows = n == 0 ? 0 : preact.numel() / (2 * n);
  auto [dz, db] = dswiglu(grad_y.reshape({rows, n}).contiguous(), preact.reshape({rows, 2 * n}).contiguous(),
                          need_dbias);
  return {dz.view(preact.sizes()), need_dbias ? db : at::empty({0}, preact.options())};
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("linear_swiglu", &parallel_layers::cuda::linear_swiglu);
  m.impl("linear_swiglu_backward", &parallel_layers::cuda::linear_swiglu_backward);
  m.impl("swiglu_backward", &parallel_layers::cuda::swiglu_backward);
}
