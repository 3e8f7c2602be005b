// How a [rows, cols] reduction over rows is split into chunks of consecutive rows.
//
// Column reductions (the bias gradient) are done in two steps that read the data once:
// every chunk writes one partial sum per column into `partials[num_chunks, cols]`
// (float accumulation), then the partials are summed. The CPU loop (one chunk per task)
// and the CUDA grid (one chunk per blockIdx.y) use this one definition, so the CPU tests
// cover the index arithmetic the GPU runs.
#pragma once

#include <cstdint>

#include "parallel_layers/macros.h"

namespace parallel_layers {

struct RowChunks {
  int64_t rows;
  int64_t rows_per_chunk;  // >= 1

  PL_HOST_DEVICE int64_t num_chunks() const {
    return (rows + rows_per_chunk - 1) / rows_per_chunk;
  }
  PL_HOST_DEVICE int64_t begin(int64_t chunk) const { return chunk * rows_per_chunk; }
  PL_HOST_DEVICE int64_t end(int64_t chunk) const {
    const int64_t e = (chunk + 1) * rows_per_chunk;
    return e < rows ? e : rows;
  }
};

// At most `max_chunks` chunks of at least `min_rows` rows each (the last may be shorter).
PL_HOST_DEVICE RowChunks make_row_chunks(int64_t rows, int64_t max_chunks, int64_t min_rows) {
  int64_t per = (rows + max_chunks - 1) / max_chunks;
  if (per < min_rows) per = min_rows;
  if (per < 1) per = 1;
  return RowChunks{rows, per};
}

}  // namespace parallel_layers
