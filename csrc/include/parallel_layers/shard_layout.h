// Index arithmetic of the flat buffers that sharded parameters are gathered into and whose
// gradients are reduce-scattered out of; shared by csrc/shard_copy.cpp and
// csrc/cuda/shard_copy_kernels.cu so the CPU tests cover what the GPU runs.
//
// N tensors, tensor i with numel n_i. Each is padded to a multiple of the world size W and cut
// into W equal shards of s_i = ceil(n_i / W) elements; rank r holds elements
// [r * s_i, (r + 1) * s_i) of the padded tensor. A rank's slot of the flat buffer is the
// concatenation of its shards, tensor i at offset o_i = s_0 + ... + s_{i-1}, total S = sum s_i.
// The all-gather / reduce-scatter buffer is [W, S], rank-major:
//   buffer[r * S + o_i + k]  <->  element r * s_i + k of tensor i   (k < s_i; past n_i: padding)
#pragma once

#include <cstdint>

#include "parallel_layers/macros.h"

namespace parallel_layers {

PL_HOST_DEVICE int64_t shard_numel(int64_t numel, int64_t world_size) {
  return (numel + world_size - 1) / world_size;
}

// The tensor that position `e` of a slot belongs to: the last i with offsets[i] <= e, where
// offsets[0..count) are the ascending start offsets o_i (tensors of zero shard size share an
// offset with the next one; the search returns the last of equal offsets, which is the one
// that owns e). Requires 0 <= e < total.
PL_HOST_DEVICE int64_t find_tensor(const int64_t* offsets, int64_t count, int64_t e) {
  int64_t lo = 0, hi = count;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= e) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Where slot position `pos` (0 <= pos < S) of rank `rank` lives in tensor i, as an element
// index of the padded tensor: rank * s_i + (pos - o_i). The caller compares it with n_i.
PL_HOST_DEVICE int64_t element_of_slot(int64_t rank, int64_t shard, int64_t offset, int64_t pos) {
  return rank * shard + (pos - offset);
}

// The CUDA ops launch once per group of at most `max_count` consecutive tensors, the group's
// table passed by value (Note [shard tables by value], parallel_layers/cuda/kernels.h). Group
// g holds tensors [first, first + count) and covers slot positions [base, base + size); a
// kernel sees positions p = pos - base and offsets o_i - base, on which find_tensor and
// element_of_slot give the same tensor and element as on the whole slot. The groups tile
// [0, S) in order; a group of only empty shards has size 0.
struct TensorGroup {
  int64_t first, count, base, size;
};

inline int64_t num_tensor_groups(int64_t count, int64_t max_count) { return (count + max_count - 1) / max_count; }

inline TensorGroup tensor_group(const int64_t* offsets, int64_t count, int64_t total, int64_t max_count, int64_t g) {
  TensorGroup t;
  t.first = g * max_count;
  t.count = count - t.first < max_count ? count - t.first : max_count;
  t.base = offsets[t.first];
  t.size = (t.first + t.count < count ? offsets[t.first + t.count] : total) - t.base;
  return t;
}

}  // namespace parallel_layers
