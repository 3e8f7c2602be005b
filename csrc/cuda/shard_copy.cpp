// Shard copy-in / copy-out on CUDA: the ops around the kernels of
// csrc/cuda/shard_copy_kernels.cu (Note [kernels apart from torch's headers],
// parallel_layers/cuda/kernels.h); csrc/shard_copy.cpp has the CPU twins and
// parallel_layers/shard_layout.h the layout. One launch per call for all tensors.
//
// The per-tensor metadata (data pointer, numel, shard size, slot offset) goes to the device
// once per call as one small int64 tensor, copied from pinned memory on the current stream.
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/cuda/kernels.h"
#include "parallel_layers/shard_copy.h"

namespace parallel_layers::cuda {
namespace {

ShardTable upload(const SlotLayout& l, at::TensorList tensors, const at::Device& device, at::Tensor& keep_alive) {
  const int64_t count = static_cast<int64_t>(l.offset.size());
  at::Tensor host = at::empty({4, count}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    h[i] = reinterpret_cast<int64_t>(tensors[i].data_ptr());
    h[count + i] = l.numel[i];
    h[2 * count + i] = l.shard[i];
    h[3 * count + i] = l.offset[i];
  }
  keep_alive = host.to(device, /*non_blocking=*/true);
  const int64_t* d = keep_alive.const_data_ptr<int64_t>();
  return ShardTable{d, d + count, d + 2 * count, d + 3 * count, count, l.total};
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
  at::Tensor meta;
  const ShardTable t = upload(l, shards, out.device(), meta);
  dispatch_pair(shards[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    launch_all_gather_copy_in<src_t, dst_t>(t, out.data_ptr<dst_t>() + rank * l.total, sms(),
                                            at::cuda::getCurrentCUDAStream());
  });
}

void all_gather_copy_out(const at::Tensor& gathered, at::TensorList outs) {
  const SlotLayout l = check_all_gather_copy_out(gathered, outs);
  const int64_t world = gathered.size(0);
  check_on_device(outs, gathered, "outs");
  if (l.total == 0 || outs.empty()) return;
  const c10::cuda::CUDAGuard guard(gathered.device());
  at::Tensor meta;
  const ShardTable t = upload(l, outs, gathered.device(), meta);
  dispatch_pair(gathered.scalar_type(), outs[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    launch_all_gather_copy_out<src_t, dst_t>(t, gathered.data_ptr<src_t>(), world, sms(),
                                             at::cuda::getCurrentCUDAStream());
  });
}

void reduce_scatter_copy_in(at::TensorList grads, const at::Tensor& out, double pre_scale) {
  const SlotLayout l = check_reduce_scatter_copy_in(grads, out);
  const int64_t world = out.size(0);
  check_on_device(grads, out, "grads");
  if (l.total == 0 || grads.empty()) return;
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor meta;
  const ShardTable t = upload(l, grads, out.device(), meta);
  dispatch_pair(grads[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    launch_reduce_scatter_copy_in<src_t, dst_t>(t, out.data_ptr<dst_t>(), world, pre_scale, sms(),
                                                at::cuda::getCurrentCUDAStream());
  });
}

void reduce_scatter_copy_out(const at::Tensor& reduced, at::TensorList shard_grads, double post_scale,
                             bool accumulate) {
  const SlotLayout l = check_reduce_scatter_copy_out(reduced, shard_grads);
  check_on_device(shard_grads, reduced, "shard_grads");
  if (l.total == 0) return;
  const c10::cuda::CUDAGuard guard(reduced.device());
  at::Tensor meta;
  const ShardTable t = upload(l, shard_grads, reduced.device(), meta);
  dispatch_pair(reduced.scalar_type(), shard_grads[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    launch_reduce_scatter_copy_out<src_t, dst_t>(t, reduced.data_ptr<src_t>(), post_scale, accumulate, sms(),
                                                 at::cuda::getCurrentCUDAStream());
  });
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("all_gather_copy_in", &parallel_layers::cuda::all_gather_copy_in);
  m.impl("all_gather_copy_out", &parallel_layers::cuda::all_gather_copy_out);
  m.impl("reduce_scatter_copy_in", &parallel_layers::cuda::reduce_scatter_copy_in);
  m.impl("reduce_scatter_copy_out", &parallel_layers::cuda::reduce_scatter_copy_out);
}
