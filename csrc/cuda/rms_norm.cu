// Fused RMSNorm on CUDA: the math of parallel_layers/rms_norm.h, as csrc/rms_norm.cpp runs it.
//
// Shapes: x, residual, sum, y, dy, dx are [rows, n] (leading dims flattened); weight, dweight
// [n]; rstd [rows]. Forward: one block per row (grid-stride over rows), two passes over the
// row - the sum of squares, reduced over the block, then the elementwise part, which re-reads
// the row from L1/L2. Backward: one block per chunk of rows (parallel_layers/row_chunks.h);
// for each row, the block reduces sum(g * h~), then writes dx and adds dy * h into its chunk's
// row of float partials (each thread owns its columns, so no atomics); the partials are summed
// afterwards in a fixed order. Sums accumulate in float (double for float64): per thread, then
// a fixed shuffle tree, so results are the same run to run.
#include <algorithm>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/rms_norm.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;

template <typename S>
using math_t = std::conditional_t<std::is_same_v<S, double>, double, float>;

// The block's sum of v, the same value in every thread. Warp shuffles, then every thread adds the
// warp totals in warp order. `shared` holds >= blockDim.x / 32 values; the closing barrier lets
// the next call reuse it.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warps = blockDim.x / kWarp;
  if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// S: x's type, W: weight / output type (S, or float for a 16-bit x).
template <typename S, typename W>
__global__ void rms_norm_forward_kernel(const S* __restrict__ x, const S* __restrict__ res, S* __restrict__ sum,
                                        const W* __restrict__ w, W* __restrict__ y, math_t<S>* __restrict__ rstd,
                                        int64_t rows, int64_t n, math_t<S> eps) {
  using M = math_t<S>;
  __shared__ M shared[kMaxThreads / kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * n;
    M sum_sq = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      S v = x[base + c];
      if (res != nullptr) {
        v = static_cast<S>(static_cast<M>(v) + static_cast<M>(res[base + c]));
        sum[base + c] = v;
      }
      const M m = static_cast<M>(v);
      sum_sq += m * m;
    }
    const M r = rms_rstd<M>(block_sum(sum_sq, shared), n, eps);
    if (threadIdx.x == 0) rstd[row] = r;
    const S* src = res != nullptr ? sum : x;  // each thread re-reads only what it wrote itself
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const M h = static_cast<M>(static_cast<S>(static_cast<M>(src[base + c]) * r));
      y[base + c] = static_cast<W>(static_cast<M>(w[c]) * h);
    }
  }
}

template <typename S, typename W>
__global__ void rms_norm_backward_kernel(const W* __restrict__ dy, const S* __restrict__ x, const W* __restrict__ w,
                                         const math_t<S>* __restrict__ rstd, const S* __restrict__ dsum,
                                         S* __restrict__ dx, math_t<S>* __restrict__ partials, RowChunks chunks,
                                         int64_t n) {
  using M = math_t<S>;
  __shared__ M shared[kMaxThreads / kWarp];
  M* acc = partials + static_cast<int64_t>(blockIdx.x) * n;
  for (int64_t row = chunks.begin(blockIdx.x); row < chunks.end(blockIdx.x); ++row) {
    const int64_t base = row * n;
    const M r = rstd[row];
    M dot = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      dot += static_cast<M>(dy[base + c]) * static_cast<M>(w[c]) * (static_cast<M>(x[base + c]) * r);
    }
    const M mean_gh = block_sum(dot, shared) / static_cast<M>(n);
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const M g = static_cast<M>(dy[base + c]);
      const M h = static_cast<M>(x[base + c]) * r;
      const M d = rms_dx<M>(g * static_cast<M>(w[c]), h, r, mean_gh);
      dx[base + c] = static_cast<S>(dsum != nullptr ? d + static_cast<M>(dsum[base + c]) : d);
      acc[c] += g * static_cast<M>(static_cast<S>(h));
    }
  }
}

// A multiple of 32 up to kMaxThreads, no wider than the row needs.
int threads_for(int64_t n) {
  const int64_t warps = std::min<int64_t>((n + kWarp - 1) / kWarp, kMaxThreads / kWarp);
  return static_cast<int>(std::max<int64_t>(warps, 1) * kWarp);
}

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
  } else if (rows > 0) {
    const int64_t blocks = std::min<int64_t>(rows, 65535 * 16);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s_tag, auto w_tag) {
      using S = decltype(s_tag);
      using W = decltype(w_tag);
      rms_norm_forward_kernel<S, W><<<static_cast<unsigned>(blocks), threads_for(n), 0, stream>>>(
          x2.const_data_ptr<S>(), cptr_or_null<S>(r2), sum.defined() ? sum.mutable_data_ptr<S>() : nullptr,
          w.const_data_ptr<W>(), y.mutable_data_ptr<W>(), rstd.mutable_data_ptr<math_t<S>>(), rows, n,
          static_cast<math_t<S>>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  // Up to 1024 chunks of >= 8 rows: enough blocks to fill the GPU, a small partials buffer.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/1024, /*min_rows=*/8);
  const at::ScalarType m = rms_math_dtype(x.scalar_type());
  at::Tensor partials = at::zeros({chunks.num_chunks(), n}, x2.options().dtype(m));
  if (n > 0 && rows > 0) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto s_tag, auto w_tag) {
      using S = decltype(s_tag);
      using W = decltype(w_tag);
      rms_norm_backward_kernel<S, W><<<static_cast<unsigned>(chunks.num_chunks()), threads_for(n), 0, stream>>>(
          dy.const_data_ptr<W>(), x2.const_data_ptr<S>(), w.const_data_ptr<W>(), rs.const_data_ptr<math_t<S>>(),
          cptr_or_null<S>(dsum), dx.mutable_data_ptr<S>(), partials.mutable_data_ptr<math_t<S>>(), chunks, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {dx.view(x.sizes()), partials.sum(0).to(weight.scalar_type())};
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("rms_norm", &parallel_layers::cuda::rms_norm);
  m.impl("rms_norm_add", &parallel_layers::cuda::rms_norm_add);
  m.impl("rms_norm_backward", &parallel_layers::cuda::rms_norm_backward);
}
