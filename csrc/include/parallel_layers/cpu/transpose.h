// Out-of-place 2-D transposes on CPU: dst[c * ld_dst + t] = src[t * ld_src + c]. Used by
// the dgelu and dswiglu passes that also write dz^T (csrc/gelu_epilogue.cpp,
// csrc/linear_swiglu.cpp) and by the transpose_2d op (csrc/transpose.cpp): ATen's bfloat16 GEMM
// wants row-major operands (Note [weight-gradient operand layout], csrc/linear_gelu.cpp).
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace parallel_layers::cpu {

#if defined(__SSE2__)
// One 8 x 8 block of 16-bit values: 8 row loads, three rounds of interleaves (16-, 32-, then
// 64-bit), 8 row stores. SSE2, so every x86-64 has it.
inline void transpose_8x8_u16(const uint16_t* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst) {
  __m128i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved, columns 0-3 / 4-7
    t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  // r[...]: 4 rows interleaved; rows 0-3 in r[0..3], rows 4-7 in r[4..7], two columns each.
  for (int h = 0; h < 2; ++h) {
    r[4 * h + 0] = _mm_unpacklo_epi32(t[4 * h + 0], t[4 * h + 2]);  // columns 0, 1
    r[4 * h + 1] = _mm_unpackhi_epi32(t[4 * h + 0], t[4 * h + 2]);  // columns 2, 3
    r[4 * h + 2] = _mm_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);  // columns 4, 5
    r[4 * h + 3] = _mm_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);  // columns 6, 7
  }
  for (int j = 0; j < 4; ++j) {  // column 2j and 2j+1: rows 0-3 from r[j], rows 4-7 from r[4 + j]
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * j) * ld_dst), _mm_unpacklo_epi64(r[j], r[4 + j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * j + 1) * ld_dst), _mm_unpackhi_epi64(r[j], r[4 + j]));
  }
}

// One 4 x 4 block of 32-bit values: 4 row loads, two rounds of interleaves, 4 row stores (SSE2).
inline void transpose_4x4_u32(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  __m128i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);  // rows 0, 1
  const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);  // rows 2, 3
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi64(t0, t2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + ld_dst), _mm_unpackhi_epi64(t0, t2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * ld_dst), _mm_unpacklo_epi64(t1, t3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * ld_dst), _mm_unpackhi_epi64(t1, t3));
}
#endif

#if defined(__SSE2__)
// The whole B x B blocks of a tile, each through `block` on U-typed elements (T's bits), source
// rows outer or columns outer; returns the rows and columns they covered.
template <int64_t B, typename U, typename T, typename Block>
inline std::pair<int64_t, int64_t> transpose_blocks(const T* src, int64_t ld_src, int64_t nt, int64_t nc, T* dst,
                                                    int64_t ld_dst, bool rows_outer, Block block) {
  static_assert(sizeof(U) == sizeof(T));
  const int64_t nt_done = nt - nt % B, nc_done = nc - nc % B;
  const auto* s = reinterpret_cast<const U*>(src);
  auto* d = reinterpret_cast<U*>(dst);
  const auto one = [&](int64_t t0, int64_t c0) { block(s + t0 * ld_src + c0, ld_src, d + c0 * ld_dst + t0, ld_dst); };
  for (int64_t i = 0; i < (rows_outer ? nt_done : nc_done); i += B) {
    for (int64_t j = 0; j < (rows_outer ? nc_done : nt_done); j += B) {
      if (rows_outer) {
        one(i, j);
      } else {
        one(j, i);
      }
    }
  }
  return {nt_done, nc_done};
}
#endif

// dst[c * ld_dst + t] = src[t * ld_src + c] for t < nt, c < nc. 16-bit types go in 8 x 8
// register blocks (SSE2): element-wise, the transposed write of 1024 x 2048 bfloat16 took
// ~2.4 ms on one thread, as much as the dgelu math itself. 32-bit types go in 4 x 4 blocks,
// source rows outer (4 rows read front to back): packing 64 float32 weight rows of 512-1024
// for the brgemm SwiGLU inference (csrc/linear_swiglu.cpp) took half the time that way than
// columns outer. The tails and other types go element by element.
template <typename T>
inline void transpose_tile(const T* src, int64_t ld_src, int64_t nt, int64_t nc, T* dst, int64_t ld_dst) {
  int64_t nt_done = 0, nc_done = 0;
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    std::tie(nt_done, nc_done) =
        transpose_blocks<8, uint16_t>(src, ld_src, nt, nc, dst, ld_dst, /*rows_outer=*/false,
                                      [](auto... args) { transpose_8x8_u16(args...); });
  } else if constexpr (sizeof(T) == 4) {
    std::tie(nt_done, nc_done) =
        transpose_blocks<4, uint32_t>(src, ld_src, nt, nc, dst, ld_dst, /*rows_outer=*/true,
                                      [](auto... args) { transpose_4x4_u32(args...); });
  }
#endif
  for (int64_t c = 0; c < nc; ++c) {  // what the blocks left: the tail rows, then the tail columns
    for (int64_t t = c < nc_done ? nt_done : 0; t < nt; ++t) dst[c * ld_dst + t] = src[t * ld_src + c];
  }
}

}  // namespace parallel_layers::cpu
