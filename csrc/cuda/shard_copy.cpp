// Shard copy-in / copy-out on CUDA: the ops around the kernels of
// csrc/cuda/shard_copy_kernels.cu (Note [kernels apart from torch's headers],
// parallel_layers/cuda/kernels.h); csrc/shard_copy.cpp has the CPU twins and
// parallel_layers/shard_layout.h the layout. One launch per group of up to ShardGroup::kMax
// tensors, the group's table passed by value (Note [shard tables by value]).
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/shard_copy.h"
#include "parallel_layers/shard_layout.h"

namespace parallel_layers::cuda {
namespace {

// launch(group) for each group of up to kMax consecutive tensors (tensor_group,
// parallel_layers/shard_layout.h), skipping groups of only empty shards.
template <typename Launch>
void for_each_group(const SlotLayout& l, at::TensorList tensors, Launch&& launch) {
  const int64_t count = static_cast<int64_t>(l.offset.size());
  for (int64_t gi = 0; gi < num_tensor_groups(count, ShardGroup::kMax); ++gi) {
    const TensorGroup tg = tensor_group(l.offset.data(), count, l.total, ShardGroup::kMax, gi);
    if (tg.size == 0) continue;
    ShardGroup g{};
    g.count = tg.count;
    g.base = tg.base;
    g.size = tg.size;
    g.total = l.total;
    for (int64_t j = 0; j < tg.count; ++j) {
      g.ptr[j] = reinterpret_cast<int64_t>(tensors[tg.first + j].data_ptr());
      g.numel[j] = l.numel[tg.first + j];
      g.shard[j] = l.shard[tg.first + j];
      g.offset[j] = l.offset[tg.first + j] - tg.base;
    }
    launch(g);
  }
}

int sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

void check_on_device(at::TensorList ts, const at::Tensor& buf, const char* what) {
  TORCH_CHECK(buf.is_cuda(), "parallel_layers shard copy (CUDA kernel) got a buffer on ", buf.device());
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK(ts[i].device() == buf.device(), what, "[", i, "] is on ", ts[i].device(), " but the buffer is on ",
                buf.device());
  }
}

}  // namespace

void all_gather_copy_in(at::TensorList shards, const at::Tensor& out, int64_t rank) {
  const SlotLayout l = check_all_gather_copy_in(shards, out, rank);
  check_on_device(shards, out, "shards");
  if (l.total == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  dispatch_pair(shards[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    for_each_group(l, shards, [&](const ShardGroup& g) {
      launch_all_gather_copy_in<src_t, dst_t>(g, out.data_ptr<dst_t>() + rank * l.total, sms(),
                                              at::cuda::getCurrentCUDAStream());
    });
  });
}

void all_gather_copy_out(const at::Tensor& gathered, at::TensorList outs) {
  const SlotLayout l = check_all_gather_copy_out(gathered, outs);
  const int64_t world = gathered.size(0);
  check_on_device(outs, gathered, "outs");
  if (l.total == 0 || outs.empty()) return;
  const c10::cuda::CUDAGuard guard(gathered.device());
  dispatch_pair(gathered.scalar_type(), outs[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    for_each_group(l, outs, [&](const ShardGroup& g) {
      launch_all_gather_copy_out<src_t, dst_t>(g, gathered.data_ptr<src_t>(), world, sms(),
                                               at::cuda::getCurrentCUDAStream());
    });
  });
}

void reduce_scatter_copy_in(at::TensorList grads, const at::Tensor& out, double pre_scale) {
  const SlotLayout l = check_reduce_scatter_copy_in(grads, out);
  const int64_t world = out.size(0);
  check_on_device(grads, out, "grads");
  if (l.total == 0 || grads.empty()) return;
  const c10::cuda::CUDAGuard guard(out.device());
  dispatch_pair(grads[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    for_each_group(l, grads, [&](const ShardGroup& g) {
      launch_reduce_scatter_copy_in<src_t, dst_t>(g, out.data_ptr<dst_t>(), world, pre_scale, sms(),
                                                  at::cuda::getCurrentCUDAStream());
    });
  });
}

void reduce_scatter_copy_out(const at::Tensor& reduced, at::TensorList shard_grads, double post_scale,
                             bool accumulate) {
  const SlotLayout l = check_reduce_scatter_copy_out(reduced, shard_grads);
  check_on_device(shard_grads, reduced, "shard_grads");
  if (l.total == 0) return;
  const c10::cuda::CUDAGuard guard(reduced.device());
  dispatch_pair(reduced.scalar_type(), shard_grads[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    for_each_group(l, shard_grads, [&](const ShardGroup& g) {
      launch_reduce_scatter_copy_out<src_t, dst_t>(g, reduced.data_ptr<src_t>(), post_scale, accumulate, sms(),
                                                   at::cuda::getCurrentCUDAStream());
    });
  });
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("all_gather_copy_in", &parallel_layers::cuda::all_gather_copy_in);
  m.impl("all_gather_copy_out", &parallel_layers::cuda::all_gather_copy_out);
  m.impl("reduce_scatter_copy_in", &parallel_layers::cuda::reduce_scatter_copy_in);
  m.impl("reduce_scatter_copy_out", &parallel_layers::cuda::reduce_scatter_copy_out);
}
