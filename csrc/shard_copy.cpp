// Shard copy-in / copy-out kernels on CPU: pack sharded parameters into the all-gather buffer
// and unpack them, and pack gradients into the reduce-scatter buffer (pad, interleave ranks,
// scale, cast) and unpack this rank's reduced chunk into float32 shard gradients. Many tensors
// per call, parallel over the flat buffer; the buffer is cut into pieces that each lie in one
// tensor (the shared slot search of parallel_layers/shard_layout.h), and each piece is one
// vectorised ATen copy/cast. Scaling of a piece happens while it is in cache.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/shard_copy.h"

namespace parallel_layers::cpu {
namespace {

constexpr int64_t kGrain = 65536;

// Calls visit(i, lo, hi) for the pieces of slot positions [begin, end) that belong to one
// tensor each (tensor i owns [o_i, o_i + s_i)), found with the shared binary search. Every
// piece is contiguous on both sides, so it is copied by one vectorised ATen call.
template <typename Visit>
void for_each_piece(const SlotLayout& l, int64_t begin, int64_t end, Visit&& visit) {
  const int64_t count = static_cast<int64_t>(l.offset.size());
  for (int64_t i = find_tensor(l.offset.data(), count, begin); i < count && l.offset[i] < end; ++i) {
    const int64_t lo = std::max(begin, l.offset[i]), hi = std::min(end, l.offset[i] + l.shard[i]);
    if (lo < hi) visit(i, lo, hi);
  }
}

// Calls visit(r, lo, hi) for the pieces of flat positions [begin, end) of a [world, S] buffer
// that stay within one row r (lo, hi are slot positions within that row).
template <typename Visit>
void for_each_row_piece(int64_t total, int64_t begin, int64_t end, Visit&& visit) {
  for (int64_t r = begin / total; r * total < end; ++r) {
    visit(r, std::max(begin, r * total) - r * total, std::min(end, (r + 1) * total) - r * total);
  }
}

// dst = scale * src, the product taken in float32 (float64 if either side is) and rounded once
// into dst's dtype, as the CUDA kernels' float accumulator does. Between float16 and bfloat16
// neither dtype holds the other (their promotion is float32): the product in the source's 16-bit
// dtype overflowed (a float16 60000 * 2 = inf where bfloat16 holds 119808) or went subnormal
// (review finding, helper-61). A piece is small enough that the second pass over dst hits the cache.
void scaled_copy(const at::Tensor& dst, const at::Tensor& src, double scale) {
  const auto wide = c10::promoteTypes(c10::promoteTypes(src.scalar_type(), dst.scalar_type()), at::kFloat);
  if (scale == 1.0) {
    dst.copy_(src);
  } else if (wide == dst.scalar_type()) {
    dst.copy_(src).mul_(scale);  // exact copy into the wide dtype, one rounding of the product
  } else {
    dst.copy_(at::mul(src.to(wide), scale));  // out of place: src.to(wide) may be src itself
  }
}

// dst += scale * src in float32 (float64 if either side is), rounded once into dst's dtype, as
// the CUDA kernel's float accumulator does: ATen's add_(src, alpha) between two 16-bit tensors
// took alpha in their dtype (a bfloat16 1/3 is 0.333984; review finding, helper-65).
void accumulate_scaled(const at::Tensor& dst, const at::Tensor& src, double scale) {
  const auto wide = c10::promoteTypes(c10::promoteTypes(src.scalar_type(), dst.scalar_type()), at::kFloat);
  if (wide == dst.scalar_type()) {
    dst.add_(src.to(wide), scale);
  } else {
    dst.copy_(dst.to(wide).add_(src.to(wide), scale));  // dst.to(wide) is a copy here
  }
}

// Elements [lo, hi) of tensor t viewed flat.
at::Tensor flat(const at::Tensor& t, int64_t lo, int64_t hi) { return t.view({-1}).slice(0, lo, hi); }

}  // namespace

void all_gather_copy_in(at::TensorList shards, const at::Tensor& out, int64_t rank) {
  const SlotLayout l = check_all_gather_copy_in(shards, out, rank);
  if (l.total == 0) return;
  const at::Tensor row = out[rank];
  at::parallel_for(0, l.total, kGrain, [&](int64_t b, int64_t e) {
    for_each_piece(l, b, e, [&](int64_t i, int64_t lo, int64_t hi) {
      row.slice(0, lo, hi).copy_(flat(shards[i], lo - l.offset[i], hi - l.offset[i]));
    });
  });
}

void all_gather_copy_out(const at::Tensor& gathered, at::TensorList outs) {
  const SlotLayout l = check_all_gather_copy_out(gathered, outs);
  const int64_t world = gathered.size(0);
  if (l.total == 0 || outs.empty()) return;
  at::parallel_for(0, world * l.total, kGrain, [&](int64_t b, int64_t e) {
    for_each_row_piece(l.total, b, e, [&](int64_t r, int64_t row_lo, int64_t row_hi) {
      for_each_piece(l, row_lo, row_hi, [&](int64_t i, int64_t lo, int64_t hi) {
        // Elements of tensor i this piece covers, cut at its unpadded end.
        const int64_t el_lo = element_of_slot(r, l.shard[i], l.offset[i], lo);
        const int64_t el_hi = std::min(element_of_slot(r, l.shard[i], l.offset[i], hi), l.numel[i]);
        if (el_lo < el_hi) flat(outs[i], el_lo, el_hi).copy_(gathered[r].slice(0, lo, lo + (el_hi - el_lo)));
      });
    });
  });
}

void reduce_scatter_copy_in(at::TensorList grads, const at::Tensor& out, double pre_scale) {
  const SlotLayout l = check_reduce_scatter_copy_in(grads, out);
  const int64_t world = out.size(0);
  if (l.total == 0 || grads.empty()) return;
  at::parallel_for(0, world * l.total, kGrain, [&](int64_t b, int64_t e) {
    for_each_row_piece(l.total, b, e, [&](int64_t r, int64_t row_lo, int64_t row_hi) {
      for_each_piece(l, row_lo, row_hi, [&](int64_t i, int64_t lo, int64_t hi) {
        const int64_t el_lo = element_of_slot(r, l.shard[i], l.offset[i], lo);
        const int64_t el_hi = std::min(element_of_slot(r, l.shard[i], l.offset[i], hi), l.numel[i]);
        const int64_t valid = std::max<int64_t>(0, el_hi - el_lo);
        at::Tensor dst = out[r].slice(0, lo, lo + valid);
        if (valid > 0) {
          // Scaled in float32 (or float64), rounded once into the buffer's dtype.
          const at::Tensor src = flat(grads[i], el_lo, el_hi);
          scaled_copy(dst, src, pre_scale);
        }
        out[r].slice(0, lo + valid, hi).zero_();  // padding past the tensor's end
      });
    });
  });
}

void reduce_scatter_copy_out(const at::Tensor& reduced, at::TensorList shard_grads, double post_scale,
                             bool accumulate) {
  const SlotLayout l = check_reduce_scatter_copy_out(reduced, shard_grads);
  if (l.total == 0) return;
  at::parallel_for(0, l.total, kGrain, [&](int64_t b, int64_t e) {
    for_each_piece(l, b, e, [&](int64_t i, int64_t lo, int64_t hi) {
      at::Tensor dst = flat(shard_grads[i], lo - l.offset[i], hi - l.offset[i]);
      const at::Tensor src = reduced.slice(0, lo, hi);
      if (accumulate) {
        accumulate_scaled(dst, src, post_scale);
      } else {
        scaled_copy(dst, src, post_scale);
      }
    });
  });
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("all_gather_copy_in", &parallel_layers::cpu::all_gather_copy_in);
  m.impl("all_gather_copy_out", &parallel_layers::cpu::all_gather_copy_out);
  m.impl("reduce_scatter_copy_in", &parallel_layers::cpu::reduce_scatter_copy_in);
  m.impl("reduce_scatter_copy_out", &parallel_layers::cpu::reduce_scatter_copy_out);
}
