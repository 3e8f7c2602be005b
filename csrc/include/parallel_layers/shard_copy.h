// Shared by the CPU and CUDA shard-copy ops: argument checks and the host-side layout
// (per-tensor shard sizes and slot offsets, see parallel_layers/shard_layout.h).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include "parallel_layers/shard_layout.h"

namespace parallel_layers {

struct SlotLayout {
  std::vector<int64_t> numel;   // n_i (for shards given as shards: s_i)
  std::vector<int64_t> shard;   // s_i
  std::vector<int64_t> offset;  // o_i
  int64_t total = 0;            // S
};

inline void check_float_type(const at::Tensor& t, const char* what) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, what,
              " must be float32, float64, float16 or bfloat16, got ", st);
}

// Layout of full tensors of the given numels, cut for `world_size` ranks.
inline SlotLayout layout_of_full(const at::TensorList tensors, int64_t world_size, const char* what) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  SlotLayout l;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous, got strides ", t.strides());
    check_float_type(t, what);
    l.numel.push_back(t.numel());
    l.shard.push_back(shard_numel(t.numel(), world_size));
    l.offset.push_back(l.total);
    l.total += l.shard.back();
  }
  return l;
}

// Layout of shards whose numels are the s_i themselves.
inline SlotLayout layout_of_shards(const at::TensorList shards, const char* what) {
  SlotLayout l;
  for (size_t i = 0; i < shards.size(); ++i) {
    const at::Tensor& t = shards[i];
    TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous, got strides ", t.strides());
    check_float_type(t, what);
    l.numel.push_back(t.numel());
    l.shard.push_back(t.numel());
    l.offset.push_back(l.total);
    l.total += t.numel();
  }
  return l;
}

inline void check_same_dtype(const at::TensorList tensors, const char* what) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(), "all ", what, " must have one dtype: ",
                what, "[0] is ", tensors[0].scalar_type(), " but ", what, "[", i, "] is ", tensors[i].scalar_type());
  }
}

inline void check_buffer(const at::Tensor& buf, int64_t rows, int64_t total, const char* what) {
  check_float_type(buf, what);
  TORCH_CHECK(buf.dim() == 2 && buf.size(0) == rows && buf.size(1) == total && buf.is_contiguous(), what,
              " must be a contiguous [", rows, ", ", total, "] buffer ([world_size, sum of shard sizes]), got shape ",
              buf.sizes(), " strides ", buf.strides());
}

// The argument checks of the four ops, shared by the CPU and CUDA entry points; each returns
// the layout of the call's tensors.
inline SlotLayout check_all_gather_copy_in(at::TensorList shards, const at::Tensor& out, int64_t rank) {
  SlotLayout l = layout_of_shards(shards, "shards");
  check_same_dtype(shards, "shards");
  const int64_t world = out.dim() > 0 ? out.size(0) : 0;
  TORCH_CHECK(rank >= 0 && rank < world, "rank ", rank, " is outside [0, ", world,
              ") (the world size is out.size(0))");
  check_buffer(out, world, l.total, "out");
  return l;
}

inline SlotLayout check_all_gather_copy_out(const at::Tensor& gathered, at::TensorList outs) {
  TORCH_CHECK(gathered.dim() == 2, "gathered must be [world_size, sum of shard sizes], got shape ", gathered.sizes());
  SlotLayout l = layout_of_full(outs, gathered.size(0), "outs");
  check_same_dtype(outs, "outs");
  check_buffer(gathered, gathered.size(0), l.total, "gathered");
  return l;
}

inline SlotLayout check_reduce_scatter_copy_in(at::TensorList grads, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2, "out must be [world_size, sum of shard sizes], got shape ", out.sizes());
  SlotLayout l = layout_of_full(grads, out.size(0), "grads");
  check_same_dtype(grads, "grads");
  check_buffer(out, out.size(0), l.total, "out");
  return l;
}

inline SlotLayout check_reduce_scatter_copy_out(const at::Tensor& reduced, at::TensorList shard_grads) {
  SlotLayout l = layout_of_shards(shard_grads, "shard_grads");
  check_same_dtype(shard_grads, "shard_grads");
  check_float_type(reduced, "reduced");
  TORCH_CHECK(reduced.dim() == 1 && reduced.numel() == l.total && reduced.is_contiguous(),
              "reduced must be a contiguous [", l.total, "] tensor (the sum of the shard sizes), got shape ",
              reduced.sizes());
  return l;
}

// Calls fn(T{}) for the C++ type T of a floating dtype (the ATen dispatch macros do not nest
// inside templates).
template <typename Fn>
void dispatch_float_type(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat: fn(float{}); break;
    case at::kDouble: fn(double{}); break;
    case at::kHalf: fn(at::Half{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "expected a float32, float64, float16 or bfloat16 tensor, got ", t);
  }
}

// Calls fn(src_t{}, dst_t{}) for the dtypes of a copy's source and destination.
template <typename Fn>
void dispatch_pair(at::ScalarType src, at::ScalarType dst, Fn&& fn) {
  dispatch_float_type(src, [&](auto s) { dispatch_float_type(dst, [&](auto d) { fn(s, d); }); });
}

}  // namespace parallel_layers
