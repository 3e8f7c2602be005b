// How the CPU fused linear ops (csrc/linear_gelu.cpp, csrc/linear_swiglu.cpp) split and buffer
// their work: the GEMM output is produced in row panels, each followed by its epilogue in
// parallel tasks of rows while the panel is still in cache; the backward's gradient of the
// pre-activation lives in per-thread scratch (Note [backward scratch on CPU]).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include <ATen/ATen.h>

namespace parallel_layers::cpu {

// Rows per panel of an [m, n] GEMM output: ~4M elements (16 MB in float32), at least 1024
// rows. Smaller panels cost GEMM speed: at the linear_gelu benchmark's shapes, bfloat16
// 2048x1024x4096 took 12.9 / 11.1 / 10.1 ms with 256 / 512 / 1024-row panels and fp32
// 4096x4096x1024 108 / 106 / 98 ms (1024 / 1024 / 4096 rows); a panel this size still sits in
// this machine's 480 MB L3 when its epilogue runs.
inline int64_t rows_per_panel(int64_t m, int64_t n) {
  const int64_t target = (int64_t{1} << 22) / std::max<int64_t>(n, 1);
  return std::min(m, std::max<int64_t>(1024, target));
}

// Rows per epilogue task over rows of n elements: ~64K elements.
inline int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)); }

// Rows [begin, end) of t, or t itself when that is all of it. A slice is a dispatcher call and a
// new TensorImpl; at sizes where one task or panel covers the whole output (x [4, 8], float32,
// ATen's GEMM) the four slices of a linear_gelu forward were ~1/4 of the op's own host time
// (perf, 468 samples in cpu::linear_gelu: slices 108, the GEMM 168).
inline at::Tensor row_range(const at::Tensor& t, int64_t begin, int64_t end) {
  return begin == 0 && end == t.size(0) ? t : t.slice(0, begin, end);
}

// A zero-filled [shape] tensor on the CPU: at::empty and a memset (all-zero bits are 0.0 in every
// floating dtype). at::zeros' fill_ went through a TensorIterator, ~2 us: a sixth of a small
// linear_gelu backward's own host time, for the bias gradient's partial sums.
inline at::Tensor zeroed(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty(shape, options);
  if (t.nbytes() > 0) std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

// The bias gradient's per-chunk partial sums of a backward pass over chunks of rows
// (parallel_layers/row_chunks.h), zeroed: [num_chunks, n], or [n] for one chunk, whose partial is
// then the gradient itself (small inputs: no sum to run). sum_bias_partials adds them in chunk
// order, rounded to dtype.
inline at::Tensor bias_partials(int64_t num_chunks, int64_t n, const at::TensorOptions& acc_options) {
  return num_chunks == 1 ? zeroed({n}, acc_options) : zeroed({num_chunks, n}, acc_options);
}
inline at::Tensor sum_bias_partials(const at::Tensor& partials, at::ScalarType dtype) {
  return (partials.dim() == 1 ? partials : partials.sum(0)).to(dtype);
}

// Note [backward scratch on CPU]: dz (and dz^T) live only inside a fused backward
// (linear_gelu_backward, linear_swiglu_backward), between its elementwise pass and the GEMMs;
// linear_swiglu's forward without a kept pre-activation also takes its GEMM output panel from
// here. ATen's CPU allocator does not cache, and glibc serves each multi-MB request with fresh
// pages - mmap above its 32 MiB threshold, or a heap it has trimmed since the last call - so
// every call paid ~0.3 ms per MB of page faults on this scratch alone: at 2048x1024x4096
// float32, 32 MiB of dz, ~10 ms of a ~180 ms training step. So the ops keep their scratch per
// thread and reuse it for every call that fits: the thread that runs the op, or, for
// linear_swiglu's float32 brgemm inference (Note [float32 SwiGLU inference through brgemm]),
// each worker thread of its parallel loop, for its weight panels and accumulators. What it holds is
// bounded: at most kMaxScratchBytes per buffer, two buffers per thread, shared by the ops;
// larger requests get a plain allocation and leave the kept one alone. Outputs are never taken
// from it, and a slot already in use (a nested call on the same thread, which nothing does
// today) falls back to a plain allocation too.
constexpr int64_t kMaxScratchBytes = int64_t{64} << 20;

struct ScratchSlot {
  at::Tensor buffer;
  bool in_use = false;
};

class Scratch {
 public:
  // A [shape] tensor of options' dtype: a view of this thread's slot when it is free and the
  // request fits the cap, else a fresh allocation. The slot is freed when this object dies.
  // Slot 0 holds dz (or a forward's GEMM panel, or brgemm weight panels), slot 1 dz^T (or
  // brgemm accumulators).
  Scratch(int slot, at::IntArrayRef shape, const at::TensorOptions& options) {
    const auto dtype = options.dtype().toScalarType();
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    // An inline function's static is one object across translation units: the ops share it.
    thread_local std::array<ScratchSlot, 2> slots;
    ScratchSlot& s = slots.at(slot);
    if (s.in_use || bytes > kMaxScratchBytes) {
      tensor_ = at::empty(shape, options);
      return;
    }
    if (!s.buffer.defined() || s.buffer.numel() < bytes) {
      s.buffer = at::Tensor();  // free the smaller one first
      s.buffer = at::empty({bytes}, options.dtype(at::kByte));
    }
    s.in_use = true;
    slot_ = &s;
    // A tensor over the slot's storage, made directly as at::empty makes one: narrow + view +
    // view were three dispatcher calls, ~18% of a small linear_gelu backward's own host time.
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(s.buffer.storage()),
                                                     c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
    impl->set_sizes_contiguous(shape);
    tensor_ = at::Tensor(std::move(impl));
  }
  ~Scratch() {
    if (slot_) slot_->in_use = false;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const at::Tensor& tensor() const { return tensor_; }

 private:
  at::Tensor tensor_;
  ScratchSlot* slot_ = nullptr;
};

}  // namespace parallel_layers::cpu
