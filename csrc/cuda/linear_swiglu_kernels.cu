// SwiGLU epilogue kernels of linear_swiglu: the math of parallel_layers/swiglu.h over the packed
// pre-activation (PackedGateUp), bias-gradient row chunks of parallel_layers/row_chunks.h, as
// the CPU op (csrc/linear_swiglu.cpp) runs them. Launched by csrc/cuda/linear_swiglu.cpp through
// parallel_layers/cuda/kernels.h (Note [kernels apart from torch's headers]).
#include <algorithm>

#include <c10/cuda/CUDAException.h>

#include "parallel_layers/cuda/column_sums.h"
#include "parallel_layers/cuda/grid.h"
#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/cuda/vec.h"
#include "parallel_layers/grid_stride.h"
#include "parallel_layers/swiglu.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per unit of V output elements (parallel_layers/cuda/vec.h), grid-stride, (row,
// unit) by RowColCursor rather than a division per unit; PackedGateUp in units (n_units = n / V).
// Math in opmath (float for 16-bit), rounded once.
template <int V, typename scalar_t>
__global__ void swiglu_forward_kernel(const scalar_t* __restrict__ z, scalar_t* __restrict__ y, int64_t units,
                                      int64_t n_units) {
  using M = opmath_t<scalar_t>;
  const PackedGateUp pk{n_units};
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  RowColCursor at(start, stride, n_units);
  for (int64_t i = start; i < units; i += stride, at.advance()) {
    const Vec<scalar_t, V> g = load_unit<V>(z, pk.gate(at.row, at.col));
    const Vec<scalar_t, V> u = load_unit<V>(z, pk.up(at.row, at.col));
    Vec<scalar_t, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out.v[k] = static_cast<scalar_t>(swiglu_forward(static_cast<M>(g.v[k]), static_cast<M>(u.v[k])));
    }
    store_unit<V>(y, i, out);
  }
}

// d_gate | d_up and their column sums, in the block shape of parallel_layers/cuda/column_sums.h:
// blockIdx.x = kUnitCols units of V output columns, blockIdx.y = one chunk of rows; PackedGateUp
// in units. Lane 0 writes the chunk's sums of the rounded d_gate and d_up to partials[chunk, col]
// and partials[chunk, n + col] - the packed layout again - unless partials is null (no bias
// gradient asked for).
template <int V, typename scalar_t>
__global__ void __launch_bounds__(kUnitCols* kRowLanes)
    swiglu_backward_kernel(const scalar_t* __restrict__ dy, const scalar_t* __restrict__ z, scalar_t* __restrict__ dz,
                           opmath_t<scalar_t>* __restrict__ partials, RowChunks chunks, int64_t n_units) {
  using M = opmath_t<scalar_t>;
  const PackedGateUp pk{n_units};
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const bool active = unit < n_units;
  M acc[2][V] = {};  // [gate, up][column of the unit]
  if (active) {
    for (int64_t r = chunks.begin(chunk) + threadIdx.y; r < chunks.end(chunk); r += kRowLanes) {
      const Vec<scalar_t, V> dyv = load_unit<V>(dy, pk.out(r, unit));
      const Vec<scalar_t, V> g = load_unit<V>(z, pk.gate(r, unit));
      const Vec<scalar_t, V> u = load_unit<V>(z, pk.up(r, unit));
      Vec<scalar_t, V> dg, du;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const auto d = parallel_layers::swiglu_backward(static_cast<M>(dyv.v[k]), static_cast<M>(g.v[k]),
                                                        static_cast<M>(u.v[k]));
        dg.v[k] = static_cast<scalar_t>(d.gate);
        du.v[k] = static_cast<scalar_t>(d.up);
        acc[0][k] += static_cast<M>(dg.v[k]);  // the rounded values, as the CPU op sums
        acc[1][k] += static_cast<M>(du.v[k]);
      }
      store_unit<V>(dz, pk.gate(r, unit), dg);
      store_unit<V>(dz, pk.up(r, unit), du);
    }
  }
  if (!partials) return;  // uniform over the grid, so no thread is left waiting in the sum
  sum_over_row_lanes(acc);
  if (active && threadIdx.y == 0) {
    const PackedGateUp cols{n_units * V};
#pragma unroll
    for (int k = 0; k < V; ++k) {
      partials[cols.gate(chunk, unit * V + k)] = acc[0][k];
      partials[cols.up(chunk, unit * V + k)] = acc[1][k];
    }
  }
}

}  // namespace

template <typename T>
void launch_swiglu_forward(const T* z, T* y, int64_t rows, int64_t n, int sms, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  dispatch_vec<T>(n % kVecElems<T> == 0 && aligned16(z) && aligned16(y), [&]<int V>() {
    const int64_t units = rows * (n / V);
    constexpr auto kernel = swiglu_forward_kernel<V, T>;
    kernel<<<grid_stride_blocks<kernel, kThreads>(units, sms), kThreads, 0, stream>>>(z, y, units, n / V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename T>
void launch_swiglu_backward(const T* dy, const T* z, T* dz, opmath_t<T>* partials, RowChunks chunks, int64_t n,
                            cudaStream_t stream) {
  if (chunks.rows == 0 || n == 0) return;
  const bool vectorizable = n % kVecElems<T> == 0 && aligned16(dy) && aligned16(z) && aligned16(dz);
  dispatch_vec<T>(vectorizable, [&]<int V>() {
    const int64_t n_units = n / V;
    swiglu_backward_kernel<V, T><<<column_sums_grid(n_units, chunks), column_sums_block(), 0, stream>>>(
        dy, z, dz, partials, chunks, n_units);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

#define PL_INSTANTIATE(T)                                                                              \
  template void launch_swiglu_forward<T>(const T*, T*, int64_t, int64_t, int, cudaStream_t);           \
  template void launch_swiglu_backward<T>(const T*, const T*, T*, opmath_t<T>*, RowChunks, int64_t,    \
                                          cudaStream_t);
PL_FOR_EACH_FLOAT_TYPE(PL_INSTANTIATE)
#undef PL_INSTANTIATE

}  // namespace parallel_layers::cuda
