// A grid-stride loop's position in a row-major [rows, n] tensor, kept as (row, col) by additions.
//
// An elementwise CUDA kernel over [rows, n] that needs the column (a bias, a packed [gate | up]
// row) would otherwise divide its flat index by n for every element. A 64-bit integer division
// is a software routine on NVIDIA GPUs (tens of instructions), while the kernel moves only 4-8
// bytes per element, so per-element division can cost more than the memory traffic it waits on.
// RowColCursor divides twice per thread, at the start, and then steps by the grid's stride with
// one add and one compare. The kernels in csrc/cuda use it; tests/cpp/test_grid_stride.cpp checks
// it on the host against i / n and i % n.
#pragma once

#include <cstdint>

#include "parallel_layers/macros.h"

namespace parallel_layers {

struct RowColCursor {
  int64_t row, col;  // of the current flat index
  int64_t n, step_rows, step_cols;

  // At flat index `start`, stepping by `stride`; n > 0.
  PL_HOST_DEVICE RowColCursor(int64_t start, int64_t stride, int64_t n_)
      : row(start / n_), col(start - row * n_), n(n_), step_rows(stride / n_), step_cols(stride - step_rows * n_) {}

  // To flat index + stride: col + step_cols < 2n, so at most one carry into row.
  PL_HOST_DEVICE void advance() {
    row += step_rows;
    col += step_cols;
    if (col >= n) {
      col -= n;
      ++row;
    }
  }
};

}  // namespace parallel_layers
