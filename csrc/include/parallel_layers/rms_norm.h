// RMSNorm (Hugging Face's LlamaRMSNorm, also Qwen2/Qwen3/Mistral) written once for every backend:
// the input checks and the entry points of both backends; the per-row math the CPU loops
// (csrc/rms_norm.cpp) and the CUDA kernels (csrc/cuda/rms_norm_kernels.cu) share is in
// parallel_layers/rms_norm_math.h.
//
// Forward of one row x[0..n) (x already x + residual for rms_norm_add), M the math type (float;
// double for float64 inputs), in the order and roundings of the Hugging Face module:
//   rstd = 1 / sqrt(M(sum x^2) / n + M(eps))      (the sum accumulated wider, see rms_norm.cpp)
//   h    = round_to_x_dtype(x * rstd)
//   y    = round_to_out_dtype(weight * h)        out dtype = promote(x, weight), as `weight * h`
// Backward, given dy (out dtype) and the saved rstd, with g = dy * weight and h~ = x * rstd:
//   dx      = rstd * (g - h~ * mean(g * h~))  (+ the sum output's gradient for rms_norm_add)
//   dweight = sum over rows of dy * h         (the rounded h the forward multiplied weight by)
// g and h~ stay in M (eager rounds g to the 16-bit dtype first; not rounding is more accurate).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/rms_norm_math.h"

namespace parallel_layers {

// The dtype rstd (and the math) has: float64 for float64 inputs, float32 otherwise.
inline at::ScalarType rms_math_dtype(at::ScalarType x) { return x == at::kDouble ? at::kDouble : at::kFloat; }

// The weight the kernels use, given x and the weight passed in. They take a weight of x's dtype,
// or float32 for a 16-bit x (output float32, as `weight * h` promotes); a weight that promotes to
// x's dtype is widened to it first (exact). Returns it contiguous.
inline at::Tensor rms_kernel_weight(const at::Tensor& x, const at::Tensor& weight) {
  const at::ScalarType xt = x.scalar_type(), wt = weight.scalar_type();
  const bool x16 = xt == at::kHalf || xt == at::kBFloat16;
  const at::ScalarType out = at::promote_types(xt, wt);
  TORCH_CHECK(out == xt || (x16 && out == at::kFloat), "rms_norm: weight of dtype ", wt, " with x of dtype ", xt,
              " would give a ", out, " output; supported: a weight of x's dtype or narrower, or a float32 or 16-bit "
              "weight with a 16-bit x");
  return (out == wt ? weight : weight.to(out)).contiguous();
}

// rms_norm / rms_norm_add (x [..., n], weight [n], residual like x); returns n.
inline int64_t check_rms_norm_args(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& residual, at::DeviceType expected,
                                   const char* op) {
  check_floating(x, "x");
  check_floating(weight, "weight");
  check_device_type(x, "x", expected, op);
  TORCH_CHECK(weight.device() == x.device(), op, ": x is on ", x.device(), " but weight is on ", weight.device(),
              "; both must be on the same device");
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must have shape [", x.size(-1),
              "] (the last dim of x ", x.sizes(), "), got ", weight.sizes());
  if (residual) {
    check_same_device_dtype(x, "x", *residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), op, ": residual has shape ", residual->sizes(), " but x has shape ",
                x.sizes(), "; they must match");
  }
  return x.size(-1);
}

// rms_norm_backward(grad_y, x, weight, rstd, grad_sum): the forward's shapes and dtypes; returns n.
inline int64_t check_rms_norm_backward_args(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& rstd, const std::optional<at::Tensor>& grad_sum,
                                            at::DeviceType expected) {
  const char* op = "rms_norm_backward";
  const int64_t n = check_rms_norm_args(x, weight, std::nullopt, expected, op);
  if (grad_sum) {
    TORCH_CHECK(grad_sum->sizes() == x.sizes() && grad_sum->scalar_type() == x.scalar_type() &&
                    grad_sum->device() == x.device(),
                op, ": grad_sum must be like x, shape ", x.sizes(), " dtype ", x.scalar_type(), "; got shape ",
                grad_sum->sizes(), " dtype ", grad_sum->scalar_type(), " on ", grad_sum->device());
  }
  const at::ScalarType out = at::promote_types(x.scalar_type(), weight.scalar_type());
  TORCH_CHECK(grad_y.sizes() == x.sizes() && grad_y.scalar_type() == out && grad_y.device() == x.device(), op,
              ": grad_y must be like the forward output, shape ", x.sizes(), " dtype ", out, " on ", x.device(),
              "; got shape ", grad_y.sizes(), " dtype ", grad_y.scalar_type(), " on ", grad_y.device());
  const at::ScalarType m = rms_math_dtype(x.scalar_type());
  TORCH_CHECK(rstd.sizes() == x.sizes().slice(0, x.dim() - 1) && rstd.scalar_type() == m &&
                  rstd.device() == x.device(),
              op, ": rstd must be the forward's, shape ", x.sizes().slice(0, x.dim() - 1), " dtype ", m, "; got shape ",
              rstd.sizes(), " dtype ", rstd.scalar_type(), " on ", rstd.device());
  return n;
}

namespace cpu {
// x [..., n], weight [n] -> (y like x in dtype promote(x, weight), rstd [...] float32 / float64).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// rms_norm of x + residual -> (y, the sum x + residual in x's dtype, rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_add(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps);
// -> (dx like x, dweight like weight); grad_sum (like x) is added to dx when given.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& grad_sum);
}  // namespace cpu

namespace cuda {
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_add(const at::Tensor& x, const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& grad_sum);
}  // namespace cuda

}  // namespace parallel_layers
