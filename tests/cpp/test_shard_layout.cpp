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

// What the CUDA ops and kernels do with a group (csrc/cuda/shard_copy.cpp, shard_copy_kernels.cu),
// replayed on the host: every slot position of every non-empty group, searched with the group's
// relative offsets, must name the tensor and element that the whole slot's search does, and the
// groups must cover each position of [0, S) exactly once.
PL_TEST(tensor_groups_tile_the_slot_and_agree_with_the_whole_table) {
  for (const int64_t max_count : {1, 3, 4, 64}) {
    for (const int64_t world : {1, 3, 8}) {
      // 150 tensors, empty ones at the group boundaries of both group sizes and in runs.
      std::vector<int64_t> numel(150), shard, offsets;
      for (int64_t i = 0; i < 150; ++i) numel[i] = (i * 7) % 13 + 1;
      for (int64_t i : {0, 1, 62, 63, 64, 65, 127, 147, 148, 149}) numel[i] = 0;
      for (int64_t i = 90; i < 100; ++i) numel[i] = 0;
      int64_t total = 0;
      for (int64_t n : numel) {
        offsets.push_back(total);
        shard.push_back(pl::shard_numel(n, world));
        total += shard.back();
      }
      const int64_t count = static_cast<int64_t>(numel.size());
      std::vector<int> covered(total, 0);
      int64_t next_first = 0, next_base = 0;
      for (int64_t g = 0; g < pl::num_tensor_groups(count, max_count); ++g) {
        const pl::TensorGroup tg = pl::tensor_group(offsets.data(), count, total, max_count, g);
        PL_CHECK(tg.first == next_first && tg.base == next_base && tg.count >= 1 && tg.count <= max_count)
            << "group " << g << " of " << max_count;
        next_first += tg.count;
        next_base += tg.size;
        if (tg.size == 0) continue;  // no launch
        std::vector<int64_t> rel(tg.count);
        for (int64_t j = 0; j < tg.count; ++j) rel[j] = offsets[tg.first + j] - tg.base;
        for (int64_t p = 0; p < tg.size; ++p) {
          const int64_t i = pl::find_tensor(rel.data(), tg.count, p);
          const int64_t whole = pl::find_tensor(offsets.data(), count, tg.base + p);
          PL_CHECK(tg.first + i == whole) << "position " << tg.base + p;
          for (int64_t r = 0; r < world; ++r) {
            PL_CHECK(pl::element_of_slot(r, shard[whole], rel[i], p) ==
                     pl::element_of_slot(r, shard[whole], offsets[whole], tg.base + p));
          }
          ++covered[tg.base + p];
        }
      }
      PL_CHECK(next_first == count && next_base == total);
      for (int64_t pos = 0; pos < total; ++pos) PL_CHECK(covered[pos] == 1) << "position " << pos;
    }
  }
}

int main() { return pl_test::run_all(); }
