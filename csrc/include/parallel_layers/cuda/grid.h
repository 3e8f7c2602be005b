// Grid sizes for the grid-stride kernels (nvcc only).
//
// Note [one resident wave for grid-stride kernels]: the elementwise and shard-copy kernels loop
// over their work with a grid-stride loop, so any grid is correct; the grid decides only how
// evenly the work lands on the SMs. Every block of such a launch takes the same share of the
// work. If the grid holds more blocks than the GPU keeps resident at once, the blocks beyond the
// first wave start only when blocks of the first finish, and run their full share as a second,
// mostly idle wave. These launches used to ask for 8 blocks of 256 threads per SM, which fits
// only kernels of <= 32 registers per thread (65536 registers per SM on sm_80 / sm_90). ptxas
// gives several of them more (-Xptxas -v, sm_90, CUDA 13.0):
//  - the bfloat16 / float16 SwiGLU forward (the one the Llama MLP runs): 40 registers;
//  - the exact-erf GeLU forward, 16-bit: 40;
//  - the shard copy-out and reduce-scatter copy-in kernels: 38-48.
// At 40 registers an SM holds 6 such blocks, so a quarter of the grid ran as a second wave at a
// quarter of the occupancy. On an H100 (HBM3, 3.35 TB/s peak) the bfloat16 SwiGLU forward over
// [8192, 2 x 14336] moved 2.7 TB/s (benchmarks/results/2026-11-26-h100.md); a second wave of a
// quarter of the data at a quarter of the occupancy fits that gap, though it was not measured
// apart from the rest.
// So the grid is at most one wave: the SM count times the blocks per SM that the CUDA runtime
// computes for the kernel as compiled (registers, shared memory, block size). The runtime
// answers once per kernel and process; a process with GPUs of different architectures gets the
// first device's answer, which can only cost speed, never correctness.
#pragma once

#include <algorithm>
#include <cstdint>

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace parallel_layers::cuda {

// How many blocks of kBlock threads of kKernel one SM keeps resident (>= 1).
template <auto kKernel, int kBlock>
int resident_blocks_per_sm() {
  static const int per_sm = [] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kBlock, /*dynamicSMemSize=*/0));
    return std::max(n, 1);
  }();
  return per_sm;
}

// Blocks of kBlock threads for a grid-stride launch of kKernel over `work` items, one item per
// thread and round: as many as the work needs, at most one resident wave on `sms` SMs (Note
// [one resident wave for grid-stride kernels]); at least 1.
template <auto kKernel, int kBlock>
unsigned grid_stride_blocks(int64_t work, int sms) {
  const int64_t wave = int64_t{sms} * resident_blocks_per_sm<kKernel, kBlock>();
  return static_cast<unsigned>(std::clamp<int64_t>((work + kBlock - 1) / kBlock, 1, std::max<int64_t>(wave, 1)));
}

}  // namespace parallel_layers::cuda
