// The building blocks of the CPU epilogue loops (csrc/gelu_epilogue.cpp, csrc/linear_swiglu.cpp):
// storage <-> float32 conversions that vectorise, and the attributes that compile a loop for
// several x86 instruction sets.
//
// An epilogue's float32 and bfloat16 inner loops are PL_ALWAYS_INLINE templates called from
// PL_SIMD_CLONES entry points, so each clone (x86-64-v4 = AVX-512 F/BW/DQ/VL, x86-64-v3 = AVX2
// with FMA, baseline; picked at load time) compiles and vectorises them for its own instruction
// set; a lambda would be a separate function left at the baseline target. The middle clone is
// x86-64-v3 rather than "avx2" because GCC's avx2 target has no FMA: its polynomials ran as
// separate multiplies and adds (Note [FMA in the AVX2 clone]). bfloat16 is converted inside the same
// loop as the math, which needs AVX-512BW for 16-bit lanes (with AVX-512F alone GCC fell back to
// 256-bit code and the fused bfloat16 loop ran slower than widening rows into float32 buffers
// first: 1024 x 2048 dgelu, one thread, 1.8 ms fused on x86-64-v4 vs 2.4 buffered vs 4.0 fused on
// avx512f). float16 goes through float32 row buffers (widen_row / narrow_row).
//
// Note [FMA in the AVX2 clone]: GCC contracts a * b + c into an FMA by default in C++
// (-ffp-contract=fast, even with -std=c++20), but only where the target has one, and target "avx2" does
// not include FMA: that clone evaluated the exp polynomial of the SiLU / GeLU gates as separate
// multiplies and adds, while the x86-64-v4 clone already used FMAs. x86-64-v3 (AVX2, FMA, F16C,
// BMI1/2: every AVX2 CPU since Haswell / Zen) fixes that; the AVX2 clone now rounds as the AVX-512
// one does. On a 2-core AVX2-only AMD EPYC, 512 x 1376 float32, both threads, min of 100 calls, two
// runs: the linear_swiglu forward epilogue (the op at K = 8 minus F.linear at K = 8) 0.633 / 0.658
// ms -> 0.514 / 0.530 ms, its backward epilogue (swiglu_backward with dbias) 0.713 / 0.705 -> 0.532
// / 0.661 ms; eager F.silu(g) * u took 0.59-0.66 ms there. csrc/rms_norm.cpp keeps its own clone
// list ("avx2"): its roundings were matched against the Hugging Face module with it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>

namespace parallel_layers::cpu {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PL_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PL_SIMD_CLONES
#endif

#if defined(__GNUC__)
#define PL_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PL_ALWAYS_INLINE inline
#endif

// Storage <-> float32 inside the SIMD loops. bfloat16 travels as its raw bits (c10's scalar
// conversions do not vectorise). Narrowing rounds to nearest even and maps NaN to the
// canonical quiet NaN: the same bits as c10::BFloat16(float).
PL_ALWAYS_INLINE float widen(float v) { return v; }
PL_ALWAYS_INLINE float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <typename S>
PL_ALWAYS_INLINE S narrow(float v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

// The pointer the SIMD loops take: bfloat16 storage as its raw bits, float32 as is.
template <typename scalar_t>
auto simd_ptr(scalar_t* p) {
  if constexpr (std::is_same_v<std::remove_const_t<scalar_t>, c10::BFloat16>) {
    using U = std::conditional_t<std::is_const_v<scalar_t>, const uint16_t, uint16_t>;
    return reinterpret_cast<U*>(p);
  } else {
    return p;
  }
}

// float16 rows <-> float32 row buffers (c10::Half's conversions).
template <typename scalar_t>
void widen_row(const scalar_t* in, float* out, int64_t n) {
  std::copy(in, in + n, out);
}

template <typename scalar_t>
void narrow_row(const float* in, scalar_t* out, int64_t n) {
  std::copy(in, in + n, out);
}

}  // namespace parallel_layers::cpu
