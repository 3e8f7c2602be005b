// The block shape of the elementwise backward kernels that also sum their output over rows (the
// bias gradients of bias_gelu and linear_swiglu; nvcc only).
//
// A block is kUnitCols x kRowLanes threads over one chunk of rows (parallel_layers/row_chunks.h)
// and kUnitCols units of V columns (parallel_layers/cuda/vec.h): threadIdx.x picks the unit, so
// a warp's loads and stores are consecutive 16-byte units of one row, and threadIdx.y = l takes
// the chunk's rows l, l + kRowLanes, ... Each thread keeps float sums for its own V columns;
// sum_over_row_lanes adds the lanes' sums in shared memory, and lane 0 writes the chunk's
// partial sums - the same partials[chunk, column] as the CPU ops, summed afterwards.
//
// Why lanes: with one row at a time per thread (the first version), a bfloat16 column unit per
// thread left 1 / 8 of the threads of an element-per-thread kernel to keep the memory busy, and
// more chunks to make up for it cost more partial sums to write and read back.
#pragma once

#include <cstdint>

#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cuda {

constexpr int kUnitCols = 32;
constexpr int kRowLanes = 8;

// The launch shape over rows of n_units units: blocks of kUnitCols x kRowLanes threads,
// gridDim.x over the units, gridDim.y = one chunk each (gridDim.y is limited to 65535; the ops
// ask for at most 256 chunks).
inline dim3 column_sums_block() { return dim3(kUnitCols, kRowLanes); }
inline dim3 column_sums_grid(int64_t n_units, const RowChunks& chunks) {
  return dim3(static_cast<unsigned>((n_units + kUnitCols - 1) / kUnitCols),
              static_cast<unsigned>(chunks.num_chunks()));
}

// acc[a][k] summed over the block's row lanes, in lane order: afterwards the threads of lane 0
// (threadIdx.y == 0) hold the block's totals, the other lanes' acc are unchanged. Every thread
// of the block must call it (it synchronises), including those past the last column.
template <int A, int V, typename M>
__device__ __forceinline__ void sum_over_row_lanes(M (&acc)[A][V]) {
  // [lane - 1][a][k][unit]: consecutive threads touch consecutive words (no bank conflicts).
  __shared__ M lanes[kRowLanes - 1][A][V][kUnitCols];
  if (threadIdx.y > 0) {
#pragma unroll
    for (int a = 0; a < A; ++a) {
#pragma unroll
      for (int k = 0; k < V; ++k) lanes[threadIdx.y - 1][a][k][threadIdx.x] = acc[a][k];
    }
  }
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int l = 0; l < kRowLanes - 1; ++l) {
#pragma unroll
      for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int k = 0; k < V; ++k) acc[a][k] += lanes[l][a][k][threadIdx.x];
      }
    }
  }
}

}  // namespace parallel_layers::cuda
