// GeLU forward and derivative, written once for every backend.
//
// The same templates run as `float` in the CUDA kernels and in the CPU SIMD loops
// (csrc/gelu_simd.cpp, vectorised by the compiler), and as `double` in the float64 paths.
// They are written to vectorise (no data-dependent branches, only selects) and to avoid
// cancellation where the textbook forms have it:
//   tanh form:  gelu(z) = z * sigmoid(2u),  u = sqrt(2/pi) (z + 0.044715 z^3)
//               (= 0.5 z (1 + tanh u), without the 1 + tanh u -> 0 cancellation for z << 0)
//   exact form: gelu(z) = z * Phi(z),  Phi(z) = erfc(-z / sqrt 2) / 2, computed from erfc of
//               |z| / sqrt 2, so Phi stays accurate in the left tail instead of 1 + erf ~ 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "parallel_layers/macros.h"

namespace parallel_layers {

// Which GeLU: "none" is the exact z * Phi(z); "tanh" is the tanh approximation that
// cuBLASLt epilogues and PyTorch's approximate="tanh" compute.
enum class GeluApprox : int { kNone = 0, kTanh = 1 };

namespace pl_math {

// e^x for float x <= 0 in straight-line code a compiler can vectorise: x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite split of ln2), e^r by its degree-7 Taylor polynomial (remainder
// < 6e-9 relative), 2^n assembled in the exponent bits. Below -80 the result is exactly 0.
// GeLU only needs x <= 0 (e^{-2|u|}, e^{-a^2}); the result is also right up to x = 88, and
// garbage above, since nothing clamps there.
//
// Note [no subnormals in the GeLU math]: x86 takes a microcode assist, ~100x slower, for every
// SIMD instruction that reads or produces a subnormal float, so the formulas built on this
// function are arranged never to produce one from normal inputs: exp returns 0 rather than a
// value near float32's smallest normal (1.2e-38), and GeLU only takes e^x of x <= 0. This is
// not only about rare inputs, because GCC if-converts a clamp by computing the polynomial on
// the unclamped lanes too and blending in a constant:
//  - With the old upper clamp (saturating at e^88), the constant was the callers' formula
//    evaluated at e^88 - the tanh gate 1 / (1 + e^88) = 6e-39, times z - so every vector paid
//    the assist: a bfloat16 GeLU pass over 2M elements took 13.6 ms, 3.4 with the CPU's
//    flush-to-zero mode on; float32 linear_gelu on large pre-activations 36.6 ms, against
//    23.3 for its GEMM.
//  - Only the lower clamp is left. In the source, lanes below -80 compute e^-80 (2^-115 and
//    the polynomial are normal) and return 0. GCC's x86-64-v4 code instead evaluates the
//    polynomial on the unclamped x of those lanes and blends in the precomputed e^-80 (checked
//    in the disassembly); those lanes stay normal too: the rounding trick keeps |r| <= ln2 / 2
//    until |x| ~ 3e6, past that r is large and the polynomial of it overflows rather than
//    underflows, and 2^n is taken from the constant, not built for them. The two-sided clamp
//    also made GCC evaluate the polynomial under masks and blend two constants: the tanh GeLU
//    forward took 0.53 ns/element, 0.44 without it.
// tests/cpp/test_bias_gelu.cpp checks MXCSR's subnormal and underflow flags over |z| up to 1e12.
PL_HOST_DEVICE float exp_poly_nonpositive(float x_in) {
  const float x = x_in < -80.0f ? -80.0f : x_in;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860676533018708e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x_in < -80.0f ? 0.0f : p * scale;
}

// e^x for x <= 0: exp_poly_nonpositive on the host; on the device the hardware exp, with the
// same 0 below -80, so both backends give the same tails (GPUs handle subnormals at full
// speed, but the results match).
//
// Note [no branches in the device math]: nvcc turns `x < -80 ? 0 : expf(x)` into a branch
// around expf, and `1.0f / d` into the reciprocal's fast path plus a branch to a slow-path
// subroutine (for d near the ends of the exponent range). Each is a divergence region
// (BSSY / BSYNC) per element, so the 8 elements of a 16-byte bfloat16 unit were computed one
// after another instead of interleaved: the tanh GeLU forward kernel was 976 SASS instructions,
// 36 divergence regions and 18 calls for 8 elements, and took 1.5x the time of PyTorch's GeLU
// kernel on an H200 (this was the likely cause; not yet re-timed without the branches).
// So the device code clamps the argument and computes expf unconditionally (a select, not a
// branch; NaN still propagates because NaN < -80 is false), and takes reciprocals with
// recip_bounded below.
PL_HOST_DEVICE float exp_nonpositive(float x) {
#if defined(__CUDA_ARCH__)
  const float e = ::expf(x < -80.0f ? -80.0f : x);
  return x < -80.0f ? 0.0f : e;
#else
  return exp_poly_nonpositive(x);
#endif
}
PL_HOST_DEVICE double exp_nonpositive(double x) { return ::exp(x); }

// 1 / d for d in [1, 8] (or NaN, which it returns). On the device: the hardware's approximate
// reciprocal and one Newton step - the same instructions as the fast path nvcc emits for an
// IEEE `1.0f / d`, so the same correctly rounded result, without the range check and the branch
// to the slow path that d in [1, 8] never needs (Note [no branches in the device math]). On
// the host a plain division, which the compiler vectorises.
PL_HOST_DEVICE float recip_bounded(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.0f), r);
#else
  return 1.0f / d;
#endif
}
PL_HOST_DEVICE double recip_bounded(double d) { return 1.0 / d; }

}  // namespace pl_math

namespace gelu_constants {
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;
// Abramowitz & Stegun 7.1.26: erfc(a) ~ t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^{-a^2},
// t = 1 / (1 + p a), a >= 0.
constexpr double kAsP = 0.3275911;
constexpr double kAs1 = 0.254829592, kAs2 = -0.284496736, kAs3 = 1.421413741, kAs4 = -1.453152027,
                 kAs5 = 1.061405429;
}  // namespace gelu_constants

// erfc(a) / 2 for a >= 0, given e^{-a^2}. float: A&S 7.1.26 (absolute error <= 7.5e-8, below
// float32 rounding of Phi near 1, and a polynomial the compiler can vectorise); double: the
// C library's erfc, since the float formula is far from float64 accuracy. Past a = 10, e^{-a^2}
// is 0 (exp_nonpositive's cut at -80), so the result is 0 whatever t is: a is clamped there,
// which keeps 1 + p a in [1, 4.3] for recip_bounded (NaN passes the clamp).
PL_HOST_DEVICE float half_erfc(float a, float exp_minus_a2) {
  using namespace gelu_constants;
  const float t = pl_math::recip_bounded(1.0f + float(kAsP) * (a > 10.0f ? 10.0f : a));
  const float poly =
      t * (float(kAs1) + t * (float(kAs2) + t * (float(kAs3) + t * (float(kAs4) + t * float(kAs5)))));
  return 0.5f * poly * exp_minus_a2;
}
PL_HOST_DEVICE double half_erfc(double a, double /*exp_minus_a2*/) { return 0.5 * ::erfc(a); }

// Phi(z) (the standard normal CDF), and e^{-z^2/2} in *gauss (the derivative needs it too).
template <typename T>
PL_HOST_DEVICE T normal_cdf(T z, T* gauss) {
  const T a = (z < T(0) ? -z : z) * T(gelu_constants::kInvSqrt2);
  *gauss = pl_math::exp_nonpositive(-a * a);
  const T tail = half_erfc(a, *gauss);  // Phi(-|z|)
  return z < T(0) ? tail : T(1) - tail;
}

// sigmoid(2u) for the tanh form; 2 du/dz in *two_du and the sigmoid's own slope
// s (1 - s) in *slope. Both from e = e^{-2|u|} <= 1: s = 1 / (1 + e) for u >= 0 and e / (1 + e)
// for u < 0, and s (1 - s) = e / (1 + e)^2 either way - no 1 - s cancellation near s = 1, and
// no e^x of a large x (Note [no subnormals in the GeLU math]).
template <typename T>
PL_HOST_DEVICE T tanh_gate(T z, T* two_du, T* slope) {
  using namespace gelu_constants;
  const T z2 = z * z;
  const T u = T(kSqrt2OverPi) * (z + T(kTanhCubic) * z2 * z);
  *two_du = T(2.0 * kSqrt2OverPi) * (T(1) + T(3.0 * kTanhCubic) * z2);
  const T e = pl_math::exp_nonpositive(T(-2) * (u < T(0) ? -u : u));
  const T inv = pl_math::recip_bounded(T(1) + e);
  *slope = e * inv * inv;
  return u < T(0) ? e * inv : inv;
}

// y = gelu(z)
template <GeluApprox kApprox, typename T>
PL_HOST_DEVICE T gelu_forward(T z) {
  T unused;
  if constexpr (kApprox == GeluApprox::kNone) {
    return z * normal_cdf(z, &unused);
  } else {
    return z * tanh_gate(z, &unused, &unused);
  }
}

// d gelu(z) / dz
template <GeluApprox kApprox, typename T>
PL_HOST_DEVICE T gelu_derivative(T z) {
  if constexpr (kApprox == GeluApprox::kNone) {
    T gauss;  // e^{-z^2/2}
    const T cdf = normal_cdf(z, &gauss);
    return cdf + z * T(gelu_constants::kInvSqrt2Pi) * gauss;
  } else {
    T two_du, slope;
    const T s = tanh_gate(z, &two_du, &slope);
    return s + z * slope * two_du;
  }
}

// Calls fn(std::integral_constant<GeluApprox, A>{}) for the runtime choice A, so kernels get
// the approximation as a template argument (no branch in the inner loop). Host code only.
template <typename Fn>
void dispatch_gelu_approx(GeluApprox approx, Fn&& fn) {
  if (approx == GeluApprox::kNone) {
    fn(std::integral_constant<GeluApprox, GeluApprox::kNone>{});
  } else {
    fn(std::integral_constant<GeluApprox, GeluApprox::kTanh>{});
  }
}

}  // namespace parallel_layers
