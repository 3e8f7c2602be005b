// Fused RMSNorm kernels: the math of parallel_layers/rms_norm.h, as csrc/rms_norm.cpp runs it.
// Launched by csrc/cuda/rms_norm.cpp through parallel_layers/cuda/kernels.h (Note [kernels
// apart from torch's headers]).
//
// Forward: one block per row (grid-stride over rows), two passes over the row - the sum of
// squares, reduced over the block, then the elementwise part, which re-reads the row from L1/L2.
// Backward: one block per chunk of rows (parallel_layers/row_chunks.h); for each row, the block
// reduces sum(g * h~), then writes dx and adds dy * h into its chunk's row of float partials
// (each thread owns its columns, so no atomics); the partials are summed afterwards in a fixed
// order. Sums accumulate in float (double for float64): per thread, then a fixed shuffle tree,
// so results are the same run to run.
//
// Note [rms_norm backward in registers]: a thread owns columns threadIdx.x + k * blockDim.x,
// k < K, for every row of its chunk, so it keeps its weight-gradient partials, the weight and
// the row's dy, h and residual gradient in registers (K a template parameter, unrolled): each
// row is one batch of independent loads, the block sum, then the stores. The arithmetic and its
// order are those of the loop version (rms_norm_backward_wide_kernel), which reads and writes its
// partials in global memory per row and re-reads the row after the block sum. Measured on an
// H100 (benchmarks/results/2026-11-26-h100.md, tools/residual_add_probe.py: GPU time of one
// forward + backward, every kernel), bfloat16 [1024, 2048] with the residual add: 85.5 us with
// the loop version (its backward kernel alone 61.6 us, ~0.3 TB/s: a chain of dependent memory
// round trips per row, one block per SM), 49.2 us with K = 8 (and chunks of >= 4 rows instead
// of 8: twice the blocks, csrc/cuda/rms_norm.cpp). At K = 16 (146 registers, one
// block per SM) [4096, 4096] went from 316 to 458 us, so rows wider than kMaxCols * kMaxThreads
// = 2048 keep the loop version, with the chunks it was measured with (>= 8 rows). That run
// loaded the residual's gradient after the block sum (a [4096, 2048] backward call took 85 us
// with it, 50 without), and the fused norm was still 7-11% slower than the add apart at 2048
// wide; it is now loaded with the row's other values, which has not run on a GPU yet.

#include <algorithm>

#include <c10/cuda/CUDAException.h>

#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/rms_norm_math.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;
constexpr int kMaxCols = 8;  // columns per thread held in registers by the backward kernel
static_assert(kMaxCols * kMaxThreads == kRmsNormRegisterWidth);

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

template <typename S, typename W>
__global__ void rms_norm_forward_kernel(const S* __restrict__ x, const S* __restrict__ res, S* __restrict__ sum,
                                        const W* __restrict__ w, W* __restrict__ y, opmath_t<S>* __restrict__ rstd,
                                        int64_t rows, int64_t n, opmath_t<S> eps) {
  using M = opmath_t<S>;
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

template <typename S, typename W, int K>
__global__ void rms_norm_backward_kernel(const W* __restrict__ dy, const S* __restrict__ x, const W* __restrict__ w,
                                         const opmath_t<S>* __restrict__ rstd, const S* __restrict__ dsum,
                                         S* __restrict__ dx, opmath_t<S>* __restrict__ partials, RowChunks chunks,
                                         int64_t n) {
  using M = opmath_t<S>;
  __shared__ M shared[kMaxThreads / kWarp];
  // Column k of this thread is threadIdx.x + k * blockDim.x; columns >= n hold zeros and are
  // neither read nor written.
  M wk[K], acc[K], g[K], h[K], ds[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    wk[k] = c < n ? static_cast<M>(w[c]) : M(0);
    acc[k] = M(0);  // 0 + v for the chunk's first row: the bits the loop version gives
  }
  for (int64_t row = chunks.begin(blockIdx.x); row < chunks.end(blockIdx.x); ++row) {
    const int64_t base = row * n;
    const M r = rstd[row];
    M dot = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      g[k] = c < n ? static_cast<M>(dy[base + c]) : M(0);
      h[k] = c < n ? static_cast<M>(x[base + c]) * r : M(0);
      ds[k] = c < n && dsum != nullptr ? static_cast<M>(dsum[base + c]) : M(0);  // before the block sum
    }
#pragma unroll
    for (int k = 0; k < K; ++k) dot += g[k] * wk[k] * h[k];  // the loop version's order
    const M mean_gh = block_sum(dot, shared) / static_cast<M>(n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < n) {
        const M d = rms_dx<M>(g[k] * wk[k], h[k], r, mean_gh);
        dx[base + c] = static_cast<S>(dsum != nullptr ? d + ds[k] : d);
        acc[k] += g[k] * static_cast<M>(static_cast<S>(h[k]));
      }
    }
  }
  M* out = partials + static_cast<int64_t>(blockIdx.x) * n;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (c < n) out[c] = acc[k];
  }
}

// The same for rows wider than kMaxCols * kMaxThreads: partials in global memory, two passes.
template <typename S, typename W>
__global__ void rms_norm_backward_wide_kernel(const W* __restrict__ dy, const S* __restrict__ x,
                                              const W* __restrict__ w, const opmath_t<S>* __restrict__ rstd,
                                              const S* __restrict__ dsum, S* __restrict__ dx,
                                              opmath_t<S>* __restrict__ partials, RowChunks chunks, int64_t n) {
  using M = opmath_t<S>;
  __shared__ M shared[kMaxThreads / kWarp];
  M* acc = partials + static_cast<int64_t>(blockIdx.x) * n;
  const int64_t first = chunks.begin(blockIdx.x);  // every chunk has a row: begin < end
  for (int64_t row = first; row < chunks.end(blockIdx.x); ++row) {
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
      // The chunk's first row starts its partial as 0 + v, the bits a zeroed buffer plus v had
      // (-0 included), so the buffer is allocated without a memset launch.
      acc[c] = (row == first ? M(0) : acc[c]) + g * static_cast<M>(static_cast<S>(h));
    }
  }
}

// A multiple of 32 up to kMaxThreads, no wider than the row needs.
int threads_for(int64_t n) {
  const int64_t warps = std::min<int64_t>((n + kWarp - 1) / kWarp, kMaxThreads / kWarp);
  return static_cast<int>(std::max<int64_t>(warps, 1) * kWarp);
}

}  // namespace

template <typename S, typename W>
void launch_rms_norm_forward(const S* x, const S* res, S* sum, const W* w, W* y, opmath_t<S>* rstd, int64_t rows,
                             int64_t n, opmath_t<S> eps, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  const int64_t blocks = std::min<int64_t>(rows, 65535 * 16);  // grid-stride over the rows beyond
  rms_norm_forward_kernel<S, W>
      <<<static_cast<unsigned>(blocks), threads_for(n), 0, stream>>>(x, res, sum, w, y, rstd, rows, n, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename S, typename W>
void launch_rms_norm_backward(const W* dy, const S* x, const W* w, const opmath_t<S>* rstd, const S* dsum, S* dx,
                              opmath_t<S>* partials, RowChunks chunks, int64_t n, cudaStream_t stream) {
  if (chunks.rows == 0 || n == 0) return;
  const int threads = threads_for(n);
  const int64_t cols = (n + threads - 1) / threads;  // per thread
  const auto blocks = static_cast<unsigned>(chunks.num_chunks());
  auto launch = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(dy, x, w, rstd, dsum, dx, partials, chunks, n);
  };
  if (cols <= 1) launch(rms_norm_backward_kernel<S, W, 1>);
  else if (cols <= 2) launch(rms_norm_backward_kernel<S, W, 2>);
  else if (cols <= 4) launch(rms_norm_backward_kernel<S, W, 4>);
  else if (cols <= kMaxCols) launch(rms_norm_backward_kernel<S, W, kMaxCols>);
  else launch(rms_norm_backward_wide_kernel<S, W>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The (x, weight) type pairs of the ops' dispatch (csrc/cuda/rms_norm.cpp).
#define PL_INSTANTIATE(S, W)                                                                                   \
  template void launch_rms_norm_forward<S, W>(const S*, const S*, S*, const W*, W*, opmath_t<S>*, int64_t,     \
                                              int64_t, opmath_t<S>, cudaStream_t);                            \
  template void launch_rms_norm_backward<S, W>(const W*, const S*, const W*, const opmath_t<S>*, const S*, S*, \
                                               opmath_t<S>*, RowChunks, int64_t, cudaStream_t);
PL_INSTANTIATE(float, float)
PL_INSTANTIATE(double, double)
PL_INSTANTIATE(c10::BFloat16, float)
PL_INSTANTIATE(c10::BFloat16, c10::BFloat16)
PL_INSTANTIATE(c10::Half, float)
PL_INSTANTIATE(c10::Half, c10::Half)
#undef PL_INSTANTIATE

}  // namespace parallel_layers::cuda
