// Shard copy-in / copy-out kernels (csrc/shard_copy.cpp has the CPU twins,
// parallel_layers/shard_layout.h the layout): one launch per group of tensors (Note [shard tables
// by value], parallel_layers/cuda/kernels.h), one thread per slot position of the group, which
// finds its tensor with the shared binary search over the group's offsets and, for the [W, S]
// buffers, visits every rank's copy of that position - no per-element division by S. Launched
// by csrc/cuda/shard_copy.cpp through parallel_layers/cuda/kernels.h (Note [kernels apart from
// torch's headers]).
#include <algorithm>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "parallel_layers/cuda/grid.h"
#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/shard_layout.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

template <typename A, typename B>
using acc_t = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

// A value moved into another float type through float (double); into its own type as it is,
// bit for bit: ZeRO carries another dtype's bits in a buffer's words (Note [carried bit for bit]
// in parallel_layers/zero/_group.py), and a round trip through float would rewrite them (a
// bfloat16 word that reads as a NaN came back as the canonical NaN: review finding, helper-81).
// The CPU twins copy with ATen's copy_, a byte copy for equal types.
template <typename src_t, typename dst_t>
__device__ __forceinline__ dst_t moved(const src_t& v) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    return v;
  } else {
    return static_cast<dst_t>(static_cast<acc_t<src_t, dst_t>>(v));
  }
}

// p: a slot position of the group (0 <= p < g.size), grid-stride.
#define PL_GRID_STRIDE(p, n) \
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < (n); p += int64_t{blockDim.x} * gridDim.x)

// The group's table is read through the constant cache (__grid_constant__: no per-thread copy
// of it); the threads of a warp mostly share a tensor, so the reads are broadcasts.
template <typename src_t, typename dst_t>
__global__ void all_gather_copy_in_kernel(const __grid_constant__ ShardGroup g, dst_t* __restrict__ row) {
  PL_GRID_STRIDE(p, g.size) {
    const int64_t i = find_tensor(g.offset, g.count, p);
    const auto* src = reinterpret_cast<const src_t*>(g.ptr[i]);
    row[g.base + p] = moved<src_t, dst_t>(src[p - g.offset[i]]);
  }
}

template <typename src_t, typename dst_t>
__global__ void all_gather_copy_out_kernel(const __grid_constant__ ShardGroup g, const src_t* __restrict__ gathered,
                                           int64_t world) {
  PL_GRID_STRIDE(p, g.size) {
    const int64_t i = find_tensor(g.offset, g.count, p);
    auto* out = reinterpret_cast<dst_t*>(g.ptr[i]);
#pragma unroll 4
    for (int64_t r = 0; r < world; ++r) {
      const int64_t el = element_of_slot(r, g.shard[i], g.offset[i], p);
      if (el < g.numel[i]) {
        out[el] = moved<src_t, dst_t>(gathered[r * g.total + g.base + p]);
      }
    }
  }
}

template <typename src_t, typename dst_t>
__global__ void reduce_scatter_copy_in_kernel(const __grid_constant__ ShardGroup g, dst_t* __restrict__ buf,
                                              int64_t world, double pre_scale) {
  using acc = acc_t<src_t, dst_t>;
  const acc scale = static_cast<acc>(pre_scale);
  PL_GRID_STRIDE(p, g.size) {
    const int64_t i = find_tensor(g.offset, g.count, p);
    const auto* src = reinterpret_cast<const src_t*>(g.ptr[i]);
#pragma unroll 4
    for (int64_t r = 0; r < world; ++r) {
      const int64_t el = element_of_slot(r, g.shard[i], g.offset[i], p);
      buf[r * g.total + g.base + p] = el < g.numel[i] ? static_cast<dst_t>(static_cast<acc>(src[el]) * scale) : dst_t(0);
    }
  }
}

template <typename src_t, typename dst_t>
__global__ void reduce_scatter_copy_out_kernel(const __grid_constant__ ShardGroup g, const src_t* __restrict__ reduced,
                                               double post_scale, bool accumulate) {
  using acc = acc_t<src_t, dst_t>;
  const acc scale = static_cast<acc>(post_scale);
  PL_GRID_STRIDE(p, g.size) {
    const int64_t i = find_tensor(g.offset, g.count, p);
    dst_t& out = reinterpret_cast<dst_t*>(g.ptr[i])[p - g.offset[i]];
    const acc v = static_cast<acc>(reduced[g.base + p]) * scale;
    out = accumulate ? static_cast<dst_t>(static_cast<acc>(out) + v) : static_cast<dst_t>(v);
  }
}

#undef PL_GRID_STRIDE

}  // namespace

template <typename Src, typename Dst>
void launch_all_gather_copy_in(const ShardGroup& g, Dst* row, int sms, cudaStream_t stream) {
  constexpr auto kernel = all_gather_copy_in_kernel<Src, Dst>;
  kernel<<<grid_stride_blocks<kernel, kThreads>(g.size, sms), kThreads, 0, stream>>>(g, row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_all_gather_copy_out(const ShardGroup& g, const Src* gathered, int64_t world, int sms, cudaStream_t stream) {
  constexpr auto kernel = all_gather_copy_out_kernel<Src, Dst>;
  kernel<<<grid_stride_blocks<kernel, kThreads>(g.size, sms), kThreads, 0, stream>>>(g, gathered, world);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_reduce_scatter_copy_in(const ShardGroup& g, Dst* buf, int64_t world, double pre_scale, int sms,
                                   cudaStream_t stream) {
  constexpr auto kernel = reduce_scatter_copy_in_kernel<Src, Dst>;
  const unsigned blocks = grid_stride_blocks<kernel, kThreads>(g.size, sms);
  kernel<<<blocks, kThreads, 0, stream>>>(g, buf, world, pre_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_reduce_scatter_copy_out(const ShardGroup& g, const Src* reduced, double post_scale, bool accumulate,
                                    int sms, cudaStream_t stream) {
  constexpr auto kernel = reduce_scatter_copy_out_kernel<Src, Dst>;
  const unsigned blocks = grid_stride_blocks<kernel, kThreads>(g.size, sms);
  kernel<<<blocks, kThreads, 0, stream>>>(g, reduced, post_scale, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Every (source, destination) pair of the four float types, as the ops' dispatch_pair reaches.
#define PL_INSTANTIATE(S, D)                                                                                     \
  template void launch_all_gather_copy_in<S, D>(const ShardGroup&, D*, int, cudaStream_t);                       \
  template void launch_all_gather_copy_out<S, D>(const ShardGroup&, const S*, int64_t, int, cudaStream_t);       \
  template void launch_reduce_scatter_copy_in<S, D>(const ShardGroup&, D*, int64_t, double, int, cudaStream_t);  \
  template void launch_reduce_scatter_copy_out<S, D>(const ShardGroup&, const S*, double, bool, int,             \
                                                     cudaStream_t);
#define PL_INSTANTIATE_FROM(S)    \
  PL_INSTANTIATE(S, float)        \
  PL_INSTANTIATE(S, double)       \
  PL_INSTANTIATE(S, c10::Half)    \
  PL_INSTANTIATE(S, c10::BFloat16)
PL_FOR_EACH_FLOAT_TYPE(PL_INSTANTIATE_FROM)
#undef PL_INSTANTIATE_FROM
#undef PL_INSTANTIATE

}  // namespace parallel_layers::cuda
