// transpose_2d on CPU: x.t().contiguous() for a 2-D x, with 16-bit types in 8 x 8 SSE2
// register blocks (parallel_layers/cpu/transpose.h), in parallel over blocks of output rows.
// linear_weight_grad uses it for the row-major dz^T that ATen's bfloat16 GEMM wants for
// dW = dz^T @ x (Note [weight-gradient operand layout], csrc/linear_gelu.cpp).
#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/cpu/transpose.h"
#include "parallel_layers/ops.h"

namespace parallel_layers::cpu {

at::Tensor transpose_2d(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "transpose_2d: x must be 2-D, got shape ", x.sizes());
  if (x.element_size() != 2 || x.numel() == 0) {
    return x.t().clone(at::MemoryFormat::Contiguous);  // a copy even where x.t() is contiguous
  }
  const at::Tensor src = x.contiguous();
  const int64_t rows = src.size(0), cols = src.size(1);
  at::Tensor out = at::empty({cols, rows}, src.options());
  const auto* s = static_cast<const uint16_t*>(src.const_data_ptr());
  auto* d = static_cast<uint16_t*>(out.mutable_data_ptr());
  // Tasks of 64 output rows (source columns); inside, 64-row slabs of the source, so a block
  // reads 64 source lines and writes 64 output lines, all held in L1.
  constexpr int64_t kCols = 64, kRows = 64;
  at::parallel_for(0, (cols + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c0 = b * kCols, nc = std::min(kCols, cols - c0);
      for (int64_t t0 = 0; t0 < rows; t0 += kRows) {
        transpose_tile(s + t0 * cols + c0, cols, std::min(kRows, rows - t0), nc, d + c0 * rows + t0, rows);
      }
    }
  });
  return out;
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) { m.impl("transpose_2d", &parallel_layers::cpu::transpose_2d); }
