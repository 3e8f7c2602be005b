// C++ unit tests of transpose_tile (parallel_layers/cpu/transpose.h): its 8 x 8 16-bit blocks,
// its 4 x 4 32-bit blocks (which pack float32 weight panels for linear_swiglu's brgemm
// inference and are not reached by the transpose_2d op) and the element-wise tails, against the
// definition dst[c * ld_dst + t] = src[t * ld_src + c], with leading dimensions wider than the
// tile and a guard that nothing outside it is written.
#include <cstdint>
#include <vector>

#include "check.h"
#include "parallel_layers/cpu/transpose.h"

namespace pl = parallel_layers;

namespace {

template <typename T>
void check_tile(int64_t nt, int64_t nc, int64_t ld_src, int64_t ld_dst) {
  std::vector<T> src(nt * ld_src);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<T>(i * 2654435761u + 1);
  const T guard = static_cast<T>(0x5a5a5a5au);
  std::vector<T> dst(nc * ld_dst, guard);
  pl::cpu::transpose_tile(src.data(), ld_src, nt, nc, dst.data(), ld_dst);
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t t = 0; t < ld_dst; ++t) {
      const T want = t < nt ? src[t * ld_src + c] : guard;
      PL_CHECK(dst[c * ld_dst + t] == want) << sizeof(T) * 8 << "-bit nt " << nt << " nc " << nc << " ld_src "
                                            << ld_src << " ld_dst " << ld_dst << " at (" << c << ", " << t << ")";
    }
  }
}

template <typename T>
void check_shapes() {
  for (int64_t nt : {1, 3, 4, 7, 8, 9, 16, 64, 70}) {
    for (int64_t nc : {1, 2, 4, 5, 8, 13, 33}) {
      check_tile<T>(nt, nc, /*ld_src=*/nc, /*ld_dst=*/nt);
      check_tile<T>(nt, nc, /*ld_src=*/nc + 3, /*ld_dst=*/nt + 5);
    }
  }
}

}  // namespace

PL_TEST(transpose_tile_16_bit_blocks_and_tails) { check_shapes<uint16_t>(); }

PL_TEST(transpose_tile_32_bit_blocks_and_tails) {
  check_shapes<uint32_t>();
  check_shapes<float>();
}

PL_TEST(transpose_tile_64_bit_element_wise) { check_shapes<uint64_t>(); }

int main() { return pl_test::run_all(); }
