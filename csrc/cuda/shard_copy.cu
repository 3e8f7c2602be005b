// Shard copy-in / copy-out kernels on CUDA (see csrc/shard_copy.cpp for the CPU twins and
// parallel_layers/shard_layout.h for the layout): one launch per call for all tensors.
//
// The per-tensor metadata (data pointer, numel, shard size, slot offset) goes to the device
// once per call as one small int64 tensor, copied from pinned memory on the current stream;
// every thread finds its tensor with the shared binary search over the slot offsets.
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/shard_copy.h"

namespace parallel_layers::cuda {
namespace {

constexpr int kThreads = 256;

// Device view of the metadata tensor [4, count]: pointers, numels, shard sizes, offsets.
struct Table {
  const int64_t* ptr;
  const int64_t* numel;
  const int64_t* shard;
  const int64_t* offset;
  int64_t count;
  int64_t total;  // S
};

Table upload(const SlotLayout& l, at::TensorList tensors, const at::Device& device, at::Tensor& keep_alive) {
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
  return Table{d, d + count, d + 2 * count, d + 3 * count, count, l.total};
}

template <typename A, typename B>
using acc_t = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

unsigned blocks_for(int64_t work) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, sms * 8)));
}

#define PL_GRID_STRIDE(i, n) \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t{blockDim.x} * gridDim.x)

template <typename src_t, typename dst_t>
__global__ void all_gather_copy_in_kernel(Table t, dst_t* __restrict__ row) {
  PL_GRID_STRIDE(pos, t.total) {
    const int64_t i = find_tensor(t.offset, t.count, pos);
    const auto* src = reinterpret_cast<const src_t*>(t.ptr[i]);
    row[pos] = static_cast<dst_t>(static_cast<acc_t<src_t, dst_t>>(src[pos - t.offset[i]]));
  }
}

template <typename src_t, typename dst_t>
__global__ void all_gather_copy_out_kernel(Table t, const src_t* __restrict__ gathered, int64_t world) {
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
__global__ void reduce_scatter_copy_in_kernel(Table t, dst_t* __restrict__ buf, int64_t world, double pre_scale) {
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
__global__ void reduce_scatter_copy_out_kernel(Table t, const src_t* __restrict__ reduced, double post_scale,
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
  const Table t = upload(l, shards, out.device(), meta);
  dispatch_pair(shards[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    all_gather_copy_in_kernel<src_t, dst_t><<<blocks_for(l.total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        t, out.data_ptr<dst_t>() + rank * l.total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void all_gather_copy_out(const at::Tensor& gathered, at::TensorList outs) {
  const SlotLayout l = check_all_gather_copy_out(gathered, outs);
  const int64_t world = gathered.size(0);
  check_on_device(outs, gathered, "outs");
  if (l.total == 0 || outs.empty()) return;
  const c10::cuda::CUDAGuard guard(gathered.device());
  at::Tensor meta;
  const Table t = upload(l, outs, gathered.device(), meta);
  dispatch_pair(gathered.scalar_type(), outs[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    all_gather_copy_out_kernel<src_t, dst_t>
        <<<blocks_for(world * l.total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            t, gathered.data_ptr<src_t>(), world);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void reduce_scatter_copy_in(at::TensorList grads, const at::Tensor& out, double pre_scale) {
  const SlotLayout l = check_reduce_scatter_copy_in(grads, out);
  const int64_t world = out.size(0);
  check_on_device(grads, out, "grads");
  if (l.total == 0 || grads.empty()) return;
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor meta;
  const Table t = upload(l, grads, out.device(), meta);
  dispatch_pair(grads[0].scalar_type(), out.scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    reduce_scatter_copy_in_kernel<src_t, dst_t>
        <<<blocks_for(world * l.total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            t, out.data_ptr<dst_t>(), world, pre_scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void reduce_scatter_copy_out(const at::Tensor& reduced, at::TensorList shard_grads, double post_scale,
                             bool accumulate) {
  const SlotLayout l = check_reduce_scatter_copy_out(reduced, shard_grads);
  check_on_device(shard_grads, reduced, "shard_grads");
  if (l.total == 0) return;
  const c10::cuda::CUDAGuard guard(reduced.device());
  at::Tensor meta;
  const Table t = upload(l, shard_grads, reduced.device(), meta);
  dispatch_pair(reduced.scalar_type(), shard_grads[0].scalar_type(), [&](auto s, auto d) {
    using src_t = decltype(s);
    using dst_t = decltype(d);
    reduce_scatter_copy_out_kernel<src_t, dst_t>
        <<<blocks_for(l.total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            t, reduced.data_ptr<src_t>(), post_scale, accumulate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("all_gather_copy_in", &parallel_layers::cuda::all_gather_copy_in);
  m.impl("all_gather_copy_out", &parallel_layers::cuda::all_gather_copy_out);
  m.impl("reduce_scatter_copy_in", &parallel_layers::cuda::reduce_scatter_copy_in);
  m.impl("reduce_scatter_copy_out", &parallel_layers::cuda::reduce_scatter_copy_out);
}
