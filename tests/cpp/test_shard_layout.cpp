// C++ unit tests of the shard layout helpers shared by the CPU and CUDA shard-copy kernels.
#include <vector>

#include "check.h"
#include "parallel_layers/shard_layout.h"

namespace pl = parallel_layers;

PL_TEST(shard_numel_pads_to_the_world_size) {
  PL_CHECK(pl::shard_numel(0, 4) == 0);
  PL_CHECK(pl::shard_numel(1, 4) == 1);  // first dim smaller than the world: ranks 1-3 hold padding
  PL_CHECK(pl::shard_numel(8, 4) == 2);
  PL_CHECK(pl::shard_numel(9, 4) == 3);
  PL_CHECK(pl::shard_numel(105, 1) == 105);
}

PL_TEST(find_tensor_owns_every_position_once) {
  // Shard sizes with empty tensors in between, at the start and at the end.
  const std::vector<int64_t> sizes = {0, 3, 0, 0, 1, 5, 0};
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (int64_t s : sizes) {
    offsets.push_back(total);
    total += s;
  }
  for (int64_t pos = 0; pos < total; ++pos) {
    const int64_t i = pl::find_tensor(offsets.data(), static_cast<int64_t>(offsets.size()), pos);
    PL_CHECK(offsets[i] <= pos && pos < offsets[i] + sizes[i]) << "pos " << pos << " -> tensor " << i;
  }
}

PL_TEST(element_of_slot_inverts_the_rank_interleave) {
  // Tensor of 10 elements over 4 ranks: shards of 3, padded to 12; slot offset 5.
  const int64_t shard = pl::shard_numel(10, 4), offset = 5;
  std::vector<int> seen(12, 0);
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t pos = offset; pos < offset + shard; ++pos) {
      const int64_t el = pl::element_of_slot(r, shard, offset, pos);
      PL_CHECK(el == r * shard + (pos - offset));
      ++seen[el];
    }
  }
  for (int count : seen) PL_CHECK(count == 1);
}

int main() { return pl_test::run_all(); }
