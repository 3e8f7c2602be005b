// Shard copy-in / copy-out kernels (csrc/shard_copy.cpp has the CPU twins,
// parallel_layers/shard_layout.h the layout): one launch per call for all tensors, each thread
// finding its tensor with the shared binary search over the table's slot offsets. Launched by
// csrc/cuda/shard_copy.cpp through parallel_layers/cuda/kernels.h (Note [kernels apart from
// torch's headers]).
#include <algorithm>
#include <type_traits>

#include <c10/cuda/CUDAException.h>

#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/shard_layout.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

template <typename A, typename B>
using acc_t = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

unsigned blocks_for(int64_t work, int sms) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, sms * 8)));
}

#define PL_GRID_STRIDE(i, n) \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t{blockDim.x} * gridDim.x)

template <typename src_t, typename dst_t>
__global__ void all_gather_copy_in_kernel(ShardTable t, dst_t* __restrict__ row) {
  PL_GRID_STRIDE(pos, t.total) {
    const int64_t i = find_tensor(t.offset, t.count, pos);
    const auto* src = reinterpret_cast<const src_t*>(t.ptr[i]);
    row[pos] = static_cast<dst_t>(static_cast<acc_t<src_t, dst_t>>(src[pos - t.offset[i]]));
  }
}

template <typename src_t, typename dst_t>
__global__ void all_gather_copy_out_kernel(ShardTable t, const src_t* __restrict__ gathered, int64_t world) {
  PL_GRID_STRIDE(idx, world * t.total) {
    const int64_t r = idx / t.total, pos = idx % t.total;
    const int64_t i = find_tensor(t.offset, t.count, pos);
    const int64_t el = element_of_slot(r, t.shard[i], t.offset[i], pos);
    if (el < t.numel[i]) {
      reinterpret_cast<dst_t*>(t.ptr[i])[el] = static_cast<dst_t>(static_cast<acc_t<src_t, dst_t>>(gathered[idx]));
    }
  }
}

template <typename src_t, typename dst_t>
__global__ void reduce_scatter_copy_in_kernel(ShardTable t, dst_t* __restrict__ buf, int64_t world, double pre_scale) {
  using acc = acc_t<src_t, dst_t>;
  const acc scale = static_cast<acc>(pre_scale);
  PL_GRID_STRIDE(idx, world * t.total) {
    const int64_t r = idx / t.total, pos = idx % t.total;
    const int64_t i = find_tensor(t.offset, t.count, pos);
    const int64_t el = element_of_slot(r, t.shard[i], t.offset[i], pos);
    const auto* src = reinterpret_cast<const src_t*>(t.ptr[i]);
    buf[idx] = el < t.numel[i] ? static_cast<dst_t>(static_cast<acc>(src[el]) * scale) : dst_t(0);
  }
}

template <typename src_t, typename dst_t>
__global__ void reduce_scatter_copy_out_kernel(ShardTable t, const src_t* __restrict__ reduced, double post_scale,
                                               bool accumulate) {
  using acc = acc_t<src_t, dst_t>;
  const acc scale = static_cast<acc>(post_scale);
  PL_GRID_STRIDE(pos, t.total) {
    const int64_t i = find_tensor(t.offset, t.count, pos);
    dst_t& g = reinterpret_cast<dst_t*>(t.ptr[i])[pos - t.offset[i]];
    const acc v = static_cast<acc>(reduced[pos]) * scale;
    g = accumulate ? static_cast<dst_t>(static_cast<acc>(g) + v) : static_cast<dst_t>(v);
  }
}

#undef PL_GRID_STRIDE

}  // namespace

template <typename Src, typename Dst>
void launch_all_gather_copy_in(ShardTable t, Dst* row, int sms, cudaStream_t stream) {
  all_gather_copy_in_kernel<Src, Dst><<<blocks_for(t.total, sms), kThreads, 0, stream>>>(t, row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_all_gather_copy_out(ShardTable t, const Src* gathered, int64_t world, int sms, cudaStream_t stream) {
  all_gather_copy_out_kernel<Src, Dst><<<blocks_for(world * t.total, sms), kThreads, 0, stream>>>(t, gathered, world);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_reduce_scatter_copy_in(ShardTable t, Dst* buf, int64_t world, double pre_scale, int sms,
                                   cudaStream_t stream) {
  reduce_scatter_copy_in_kernel<Src, Dst>
      <<<blocks_for(world * t.total, sms), kThreads, 0, stream>>>(t, buf, world, pre_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Src, typename Dst>
void launch_reduce_scatter_copy_out(ShardTable t, const Src* reduced, double post_scale, bool accumulate, int sms,
                                    cudaStream_t stream) {
  reduce_scatter_copy_out_kernel<Src, Dst>
      <<<blocks_for(t.total, sms), kThreads, 0, stream>>>(t, reduced, post_scale, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Every (source, destination) pair of the four float types, as the ops' dispatch_pair reaches.
#define PL_INSTANTIATE(S, D)                                                                                     \
  template void launch_all_gather_copy_in<S, D>(ShardTable, D*, int, cudaStream_t);                              \
  template void launch_all_gather_copy_out<S, D>(ShardTable, const S*, int64_t, int, cudaStream_t);              \
  template void launch_reduce_scatter_copy_in<S, D>(ShardTable, D*, int64_t, double, int, cudaStream_t);         \
  template void launch_reduce_scatter_copy_out<S, D>(ShardTable, const S*, double, bool, int, cudaStream_t);
#define PL_INSTANTIATE_FROM(S)    \
  PL_INSTANTIATE(S, float)        \
  PL_INSTANTIATE(S, double)       \
  PL_INSTANTIATE(S, c10::Half)    \
  PL_INSTANTIATE(S, c10::BFloat16)
PL_FOR_EACH_FLOAT_TYPE(PL_INSTANTIATE_FROM)
#undef PL_INSTANTIATE_FROM
#undef PL_INSTANTIATE

}  // namespace parallel_layers::cuda
