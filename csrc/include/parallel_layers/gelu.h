// GeLU forward and derivative, written once for every backend.
//
// The formulas are templates over the value type `T`, so the same text runs as
//   - `float` / `double` in the CUDA kernels and in the scalar tails of CPU loops,
//   - `at::vec::Vectorized<float>` / `<double>` in the vectorised CPU loops.
// `T` needs +, -, * with itself and construction from a scalar; transcendental
// functions are reached through the overload set in `pl_math` (scalar overloads here,
// Vectorized overloads in csrc/include/parallel_layers/cpu_vec_math.h).
#pragma once

#include <cmath>
#include <type_traits>

#include "parallel_layers/macros.h"

namespace parallel_layers {

// Which GeLU: "none" is the exact x * Phi(x); "tanh" is the tanh approximation
// that cuBLASLt epilogues and PyTorch's approximate="tanh" compute.
enum class GeluApprox : int { kNone = 0, kTanh = 1 };

namespace pl_math {
PL_HOST_DEVICE float erf(float x) { return ::erff(x); }
PL_HOST_DEVICE double erf(double x) { return ::erf(x); }
PL_HOST_DEVICE float tanh(float x) { return ::tanhf(x); }
PL_HOST_DEVICE double tanh(double x) { return ::tanh(x); }
PL_HOST_DEVICE float exp(float x) { return ::expf(x); }
PL_HOST_DEVICE double exp(double x) { return ::exp(x); }
}  // namespace pl_math

namespace gelu_constants {
// 1/sqrt(2), 1/sqrt(2*pi), sqrt(2/pi) and the cubic coefficient of the tanh form.
constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;
}  // namespace gelu_constants

// y = gelu(z)
template <GeluApprox kApprox, typename T>
PL_HOST_DEVICE T gelu_forward(T z) {
  using namespace gelu_constants;
  const T half(0.5), one(1.0);
  if constexpr (kApprox == GeluApprox::kNone) {
    return half * z * (one + pl_math::erf(z * T(kSqrtHalf)));
  } else {
    const T inner = T(kSqrt2OverPi) * (z + T(kTanhCubic) * z * z * z);
    return half * z * (one + pl_math::tanh(inner));
  }
}

// d gelu(z) / dz
template <GeluApprox kApprox, typename T>
PL_HOST_DEVICE T gelu_derivative(T z) {
  using namespace gelu_constants;
  const T half(0.5), one(1.0);
  if constexpr (kApprox == GeluApprox::kNone) {
    // Phi(z) + z * phi(z)
    const T cdf = half * (one + pl_math::erf(z * T(kSqrtHalf)));
    const T pdf = T(kInvSqrt2Pi) * pl_math::exp(T(-0.5) * z * z);
    return cdf + z * pdf;
  } else {
    const T z2 = z * z;
    const T t = pl_math::tanh(T(kSqrt2OverPi) * (z + T(kTanhCubic) * z2 * z));
    const T dinner = T(kSqrt2OverPi) * (one + T(3.0 * kTanhCubic) * z2);
    return half * (one + t) + half * z * (one - t * t) * dinner;
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
