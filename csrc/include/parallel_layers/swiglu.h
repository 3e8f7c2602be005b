// SwiGLU and its derivatives, written once for every backend, and the packed layout of a
// linear SwiGLU layer's pre-activation.
//
//   y = silu(g) * u,  silu(g) = g * s,  s = sigmoid(g)
//   dL/du = dy * silu(g)
//   dL/dg = dy * u * silu'(g),  silu'(g) = s + g * s * (1 - s)
//
// The same templates run as `float` in the CUDA kernels and in the CPU SIMD loops, and as
// `double` in the float64 paths. s and s (1 - s) come from e = e^{-|g|} <= 1, as the tanh GeLU
// gate does (parallel_layers/gelu.h): s = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0, and
// s (1 - s) = e / (1 + e)^2 either way - no 1 - s cancellation, no e^x of a large x, and so no
// subnormals from normal inputs (Note [no subnormals in the GeLU math]).
#pragma once

#include <cstdint>

#include "parallel_layers/gelu.h"
#include "parallel_layers/macros.h"

namespace parallel_layers {

// The packed pre-activation of `linear_swiglu`: the GEMM against weight [2n, k] (gate rows
// [0, n) stacked on up rows [n, 2n)) gives rows of 2n, gate in columns [0, n) and up in
// [n, 2n); the output has rows of n. Flat indices of row `row`, output column `col` < n.
struct PackedGateUp {
  int64_t n;

  PL_HOST_DEVICE int64_t gate(int64_t row, int64_t col) const { return row * 2 * n + col; }
  PL_HOST_DEVICE int64_t up(int64_t row, int64_t col) const { return row * 2 * n + n + col; }
  PL_HOST_DEVICE int64_t out(int64_t row, int64_t col) const { return row * n + col; }
};

// sigmoid(g), and its slope sigmoid(g) (1 - sigmoid(g)) in *slope.
template <typename T>
PL_HOST_DEVICE T sigmoid_with_slope(T g, T* slope) {
  const T e = pl_math::exp_nonpositive(g < T(0) ? g : -g);
  const T inv = pl_math::recip_bounded(T(1) + e);
  *slope = e * inv * inv;
  return g < T(0) ? e * inv : inv;
}

// silu(g) * u
template <typename T>
PL_HOST_DEVICE T swiglu_forward(T g, T u) {
  T unused;
  return g * sigmoid_with_slope(g, &unused) * u;
}

// The gradients of the gate and up pre-activations.
template <typename T>
struct SwigluGrads {
  T gate, up;
};

// Note [results by value in SIMD loops]: the gradients come back by value, not through pointers
// to the caller's locals. GCC lowers `#pragma omp simd` before it inlines, so a local whose
// address a loop body passes on becomes a per-lane "omp simd array" sized for the translation
// unit's baseline target, and the x86-64-v4 clone vectorised around it with 256-bit vectors: the
// bfloat16 backward loop took 0.75 ms (1.12 with the bias sums) for 512 x 1376 on one Zen 4
// thread, 0.54 (0.73) with the results returned by value; float32 was unaffected (0.36).
template <typename T>
PL_HOST_DEVICE SwigluGrads<T> swiglu_backward(T dy, T g, T u) {
  T slope;
  const T s = sigmoid_with_slope(g, &slope);
  return {dy * u * (s + g * slope), dy * (g * s)};
}

}  // namespace parallel_layers
