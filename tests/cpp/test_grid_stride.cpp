// C++ unit tests of RowColCursor (parallel_layers/grid_stride.h), the (row, col) bookkeeping of
// the CUDA elementwise kernels' grid-stride loops, run here on the host.
#include <cstdint>

#include "check.h"
#include "parallel_layers/grid_stride.h"

namespace pl = parallel_layers;

namespace {

// Every thread's walk over [0, numel) agrees with i / n and i % n at each step.
void check_walk(int64_t numel, int64_t n, int64_t stride) {
  int64_t visited = 0;
  for (int64_t start = 0; start < stride && start < numel; ++start) {
    pl::RowColCursor at(start, stride, n);
    for (int64_t i = start; i < numel; i += stride, at.advance()) {
      PL_CHECK(at.row == i / n && at.col == i % n)
          << "numel " << numel << " n " << n << " stride " << stride << " i " << i << ": (" << at.row << ", "
          << at.col << ")";
      ++visited;
    }
  }
  PL_CHECK(visited == numel) << "numel " << numel << " n " << n << " stride " << stride << " visited " << visited;
}

}  // namespace

PL_TEST(cursor_matches_division_for_strides_below_at_and_above_the_row) {
  for (int64_t n : {1, 2, 3, 7, 32, 33, 255, 256, 257, 1000}) {
    for (int64_t stride : {1, 2, 5, 31, 256, 257, 1024, 3000}) {
      check_walk(/*numel=*/n * 11 + (n > 1 ? n / 2 : 0), n, stride);
    }
  }
}

PL_TEST(cursor_stride_a_multiple_of_the_row_keeps_the_column) {
  const int64_t n = 48;
  for (int64_t k : {1, 2, 5}) check_walk(n * 40, n, k * n);
}

PL_TEST(cursor_handles_rows_beyond_32_bits) {
  // A row index past 2^31 and a flat index past 2^40, as a huge tensor would give.
  const int64_t n = 4097, stride = int64_t{132} * 8 * 256;
  const int64_t start = (int64_t{1} << 40) + 12345;
  pl::RowColCursor at(start, stride, n);
  for (int64_t i = start; i < start + 1000 * stride; i += stride, at.advance()) {
    PL_CHECK(at.row == i / n && at.col == i % n) << "i " << i;
  }
}

int main() { return pl_test::run_all(); }
