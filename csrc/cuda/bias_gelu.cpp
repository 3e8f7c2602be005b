// Fused bias-add + GeLU on CUDA: the ops around the kernels of csrc/cuda/bias_gelu_kernels.cu
// (Note [kernels apart from torch's headers], parallel_layers/cuda/kernels.h). The same math
// as csrc/bias_gelu.cpp (parallel_layers/gelu.h) and the same row chunking for the bias
// gradient (parallel_layers/row_chunks.h).
//
// Shapes: x, y, z, dy, dz are [rows, n] (leading dims flattened); bias, dbias are [n].
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

// y = gelu(x_c + bias) into y, and the pre-activation into z when z is defined; x_c, y, z
// contiguous [.., n], bias contiguous [n] or undefined.
void forward(const at::Tensor& x_c, const at::Tensor& bias, const at::Tensor& y, const at::Tensor& z,
             GeluApprox approx, int64_t n) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_c.scalar_type(), "bias_gelu_cuda", [&] {
    launch_bias_gelu_forward<scalar_t>(
        x_c.const_data_ptr<scalar_t>(), bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
        y.mutable_data_ptr<scalar_t>(), z.defined() ? z.mutable_data_ptr<scalar_t>() : nullptr, x_c.numel(), n,
        approx, sms, at::cuda::getCurrentCUDAStream());
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias,
                                             std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_args(x, bias, at::kCUDA);

  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x_c = x.contiguous();
  at::Tensor y = at::empty_like(x_c);
  at::Tensor z = at::empty_like(x_c);
  forward(x_c, bias.contiguous(), y, z, approx, n);
  return {y, z};
}

at::Tensor gelu_only(const at::Tensor& z, std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const c10::cuda::CUDAGuard guard(z.device());
  const at::Tensor z_c = z.contiguous();
  at::Tensor y = at::empty_like(z_c);
  forward(z_c, at::Tensor(), y, at::Tensor(), approx, /*n=*/1);  // n is only read with a bias
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& preact,
                                                      std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_backward_args(grad_out, preact, at::kCUDA);

  const c10::cuda::CUDAGuard guard(preact.device());
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor z = preact.contiguous();
  at::Tensor dz = at::empty_like(z);
  const int64_t rows = n == 0 ? 0 : z.numel() / n;
  // Up to 256 chunks of >= 32 rows (>= 4 per row lane of parallel_layers/cuda/column_sums.h):
  // enough blocks to fill the GPU for narrow n, partial sums of at most 1 / 16 of dz's bytes.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, /*min_rows=*/32);
  at::Tensor partials = at::empty({chunks.num_chunks(), n}, z.options().dtype(at::toOpMathType(z.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "bias_gelu_backward_cuda", [&] {
    launch_bias_gelu_backward<scalar_t>(dy.const_data_ptr<scalar_t>(), z.const_data_ptr<scalar_t>(),
                                        dz.mutable_data_ptr<scalar_t>(),
                                        partials.mutable_data_ptr<opmath_t<scalar_t>>(), chunks, n, approx,
                                        at::cuda::getCurrentCUDAStream());
  });
  at::Tensor dbias = partials.sum(0).to(z.scalar_type());
  return {dz, dbias};
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("bias_gelu", &parallel_layers::cuda::bias_gelu);
  m.impl("bias_gelu_backward", &parallel_layers::cuda::bias_gelu_backward);
}
