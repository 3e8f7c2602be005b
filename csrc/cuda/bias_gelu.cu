// Fused bias-add + GeLU on CUDA: the same math as csrc/bias_gelu.cpp (parallel_layers/gelu.h)
// and the same row chunking for the bias gradient (parallel_layers/row_chunks.h).
//
// Shapes: x, y, z, dy, dz are [rows, n] (leading dims flattened); bias, dbias are [n].
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/gelu.h"
#include "parallel_layers/ops.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per element, grid-stride; column = flat index mod n. bias and z may be null
// (GeLU only, for linear_gelu's fallback, whose GEMM has already added the bias).
template <GeluApprox kApprox, typename scalar_t>
__global__ void bias_gelu_forward_kernel(const scalar_t* __restrict__ x,
                                         const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                                         scalar_t* __restrict__ z, int64_t numel, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    const opmath_t xi = static_cast<opmath_t>(x[i]);
    const opmath_t pre = bias ? xi + static_cast<opmath_t>(bias[i % n]) : xi;  // keeps -0.0 without a bias
    if (z) z[i] = static_cast<scalar_t>(pre);
    y[i] = static_cast<scalar_t>(gelu_forward<kApprox>(pre));
  }
}

// y = gelu(x_c + bias) into y, and the pre-activation into z when z is defined; x_c, y, z
// contiguous [.., n], bias contiguous [n] or undefined.
void launch_forward(const at::Tensor& x_c, const at::Tensor& bias, const at::Tensor& y, const at::Tensor& z,
                    GeluApprox approx, int64_t n) {
  const int64_t numel = x_c.numel();
  if (numel == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, int64_t{sms} * 8);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_c.scalar_type(), "bias_gelu_cuda", [&] {
    dispatch_gelu_approx(approx, [&](auto a) {
      bias_gelu_forward_kernel<decltype(a)::value, scalar_t>
          <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
              x_c.const_data_ptr<scalar_t>(), bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
              y.mutable_data_ptr<scalar_t>(), z.defined() ? z.mutable_data_ptr<scalar_t>() : nullptr, numel, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Thread = one column, blockIdx.y = one chunk of rows: consecutive threads read consecutive
// columns (coalesced), and each writes its chunk's column sum to partials[chunk, col].
template <GeluApprox kApprox, typename scalar_t>
__global__ void bias_gelu_backward_kernel(const scalar_t* __restrict__ dy,
                                          const scalar_t* __restrict__ z, scalar_t* __restrict__ dz,
                                          at::opmath_type<scalar_t>* __restrict__ partials,
                                          RowChunks chunks, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (col >= n) return;
  opmath_t acc = 0;
  for (int64_t r = chunks.begin(chunk); r < chunks.end(chunk); ++r) {
    const int64_t i = r * n + col;
    const opmath_t g = static_cast<opmath_t>(dy[i]) * gelu_derivative<kApprox>(static_cast<opmath_t>(z[i]));
    const scalar_t g_rounded = static_cast<scalar_t>(g);
    dz[i] = g_rounded;
    acc += static_cast<opmath_t>(g_rounded);  // the rounded values, as the CPU op and eager sum
  }
  partials[chunk * n + col] = acc;
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
  launch_forward(x_c, bias.contiguous(), y, z, approx, n);
  return {y, z};
}

at::Tensor gelu_only(const at::Tensor& z, std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const c10::cuda::CUDAGuard guard(z.device());
  const at::Tensor z_c = z.contiguous();
  at::Tensor y = at::empty_like(z_c);
  launch_forward(z_c, at::Tensor(), y, at::Tensor(), approx, /*n=*/1);  // n is only read with a bias
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
  // Up to 256 chunks of >= 16 rows: enough blocks to fill the GPU for narrow n, a small
  // partials buffer for wide n. gridDim.y is limited to 65535, far above 256.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, /*min_rows=*/16);
  const auto opmath = at::toOpMathType(z.scalar_type());
  at::Tensor partials = at::empty({chunks.num_chunks(), n}, z.options().dtype(opmath));
  if (rows > 0) {
    const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads),
                    static_cast<unsigned>(chunks.num_chunks()));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "bias_gelu_backward_cuda", [&] {
      dispatch_gelu_approx(approx, [&](auto a) {
        bias_gelu_backward_kernel<decltype(a)::value, scalar_t><<<grid, kThreads, 0, stream>>>(
            dy.const_data_ptr<scalar_t>(), z.const_data_ptr<scalar_t>(), dz.mutable_data_ptr<scalar_t>(),
            partials.mutable_data_ptr<at::opmath_type<scalar_t>>(), chunks, n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  at::Tensor dbias = partials.sum(0).to(z.scalar_type());
  return {dz, dbias};
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("bias_gelu", &parallel_layers::cuda::bias_gelu);
  m.impl("bias_gelu_backward", &parallel_layers::cuda::bias_gelu_backward);
}
