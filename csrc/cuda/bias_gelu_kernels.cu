// Fused bias-add + GeLU kernels: the math of parallel_layers/gelu.h (as csrc/bias_gelu.cpp
// runs it) and the row chunks of parallel_layers/row_chunks.h for the bias gradient, summed in
// the block shape of parallel_layers/cuda/column_sums.h. Launched by csrc/cuda/bias_gelu.cpp and
// csrc/cuda/linear_gelu.cpp through parallel_layers/cuda/kernels.h (Note [kernels apart from
// torch's headers]).
#include <algorithm>

#include <c10/cuda/CUDAException.h>

#include "parallel_layers/cuda/column_sums.h"
#include "parallel_layers/cuda/grid.h"
#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/cuda/vec.h"
#include "parallel_layers/grid_stride.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per unit of V elements (parallel_layers/cuda/vec.h), grid-stride; the bias's unit
// kept by RowColCursor rather than a division per unit. bias and z may be null (GeLU only, for
// linear_gelu's fallback, whose GEMM has already added the bias).
template <GeluApprox kApprox, int V, typename scalar_t>
__global__ void bias_gelu_forward_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                                         scalar_t* __restrict__ y, scalar_t* __restrict__ z, int64_t units,
                                         int64_t n_units) {
  using M = opmath_t<scalar_t>;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  RowColCursor at(start, stride, n_units);
  for (int64_t i = start; i < units; i += stride, at.advance()) {
    const Vec<scalar_t, V> xv = load_unit<V>(x, i);
    Vec<scalar_t, V> bv{};
    if (bias) bv = load_unit<V>(bias, at.col);
    Vec<scalar_t, V> yv, zv;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const M xi = static_cast<M>(xv.v[k]);
      const M pre = bias ? xi + static_cast<M>(bv.v[k]) : xi;  // keeps -0.0 without a bias
      zv.v[k] = static_cast<scalar_t>(pre);
      yv.v[k] = static_cast<scalar_t>(gelu_forward<kApprox>(pre));
    }
    if (z) store_unit<V>(z, i, zv);
    store_unit<V>(y, i, yv);
  }
}

// dz = dy * gelu'(z) and its column sums, in the block shape of parallel_layers/cuda/column_sums.h:
// blockIdx.x = kUnitCols units of V columns, blockIdx.y = one chunk of rows; lane 0 writes the
// chunk's sums of the rounded dz to partials[chunk, col].
template <GeluApprox kApprox, int V, typename scalar_t>
__global__ void __launch_bounds__(kUnitCols* kRowLanes)
    bias_gelu_backward_kernel(const scalar_t* __restrict__ dy, const scalar_t* __restrict__ z,
                              scalar_t* __restrict__ dz, opmath_t<scalar_t>* __restrict__ partials, RowChunks chunks,
                              int64_t n_units) {
  using M = opmath_t<scalar_t>;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const bool active = unit < n_units;
  M acc[1][V] = {};
  if (active) {
    for (int64_t r = chunks.begin(chunk) + threadIdx.y; r < chunks.end(chunk); r += kRowLanes) {
      const int64_t i = r * n_units + unit;
      const Vec<scalar_t, V> dyv = load_unit<V>(dy, i);
      const Vec<scalar_t, V> zv = load_unit<V>(z, i);
      Vec<scalar_t, V> dzv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        dzv.v[k] = static_cast<scalar_t>(static_cast<M>(dyv.v[k]) * gelu_derivative<kApprox>(static_cast<M>(zv.v[k])));
        acc[0][k] += static_cast<M>(dzv.v[k]);  // the rounded values, as the CPU op and eager sum
      }
      store_unit<V>(dz, i, dzv);
    }
  }
  sum_over_row_lanes(acc);  // every thread: it synchronises
  if (active && threadIdx.y == 0) {
#pragma unroll
    for (int k = 0; k < V; ++k) partials[chunk * n_units * V + unit * V + k] = acc[0][k];
  }
}

}  // namespace

template <typename T>
void launch_bias_gelu_forward(const T* x, const T* bias, T* y, T* z, int64_t numel, int64_t n, GeluApprox approx,
                              int sms, cudaStream_t stream) {
  if (numel == 0) return;
  // Without a bias the columns do not matter: one row of numel elements.
  const int64_t cols = bias ? n : numel;
  const bool vectorizable = cols % kVecElems<T> == 0 && aligned16(x) && aligned16(y) && (!z || aligned16(z)) &&
                            (!bias || aligned16(bias));
  dispatch_vec<T>(vectorizable, [&]<int V>() {
    const int64_t units = numel / V;
    dispatch_gelu_approx(approx, [&](auto a) {
      constexpr auto kernel = bias_gelu_forward_kernel<decltype(a)::value, V, T>;
      kernel<<<grid_stride_blocks<kernel, kThreads>(units, sms), kThreads, 0, stream>>>(x, bias, y, z, units,
                                                                                          cols / V);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

template <typename T>
void launch_bias_gelu_backward(const T* dy, const T* z, T* dz, opmath_t<T>* partials, RowChunks chunks, int64_t n,
                               GeluApprox approx, cudaStream_t stream) {
  if (chunks.rows == 0 || n == 0) return;
  const bool vectorizable = n % kVecElems<T> == 0 && aligned16(dy) && aligned16(z) && aligned16(dz);
  dispatch_vec<T>(vectorizable, [&]<int V>() {
    const int64_t n_units = n / V;
    dispatch_gelu_approx(approx, [&](auto a) {
      bias_gelu_backward_kernel<decltype(a)::value, V, T>
          <<<column_sums_grid(n_units, chunks), column_sums_block(), 0, stream>>>(dy, z, dz, partials, chunks,
                                                                                  n_units);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

#define PL_INSTANTIATE(T)                                                                                      \
  template void launch_bias_gelu_forward<T>(const T*, const T*, T*, T*, int64_t, int64_t, GeluApprox, int,     \
                                            cudaStream_t);                                                    \
  template void launch_bias_gelu_backward<T>(const T*, const T*, T*, opmath_t<T>*, RowChunks, int64_t,         \
                                             GeluApprox, cudaStream_t);
PL_FOR_EACH_FLOAT_TYPE(PL_INSTANTIATE)
#undef PL_INSTANTIATE

}  // namespace parallel_layers::cuda
