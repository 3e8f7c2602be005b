// Input checks shared by the op implementations; every message names the offending values.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "parallel_layers/gelu.h"

namespace parallel_layers {

// Product of all dims but the last: the row count of t viewed as [rows, t.size(-1)]
// (well defined when the last dim is 0, unlike view({-1, 0})).
inline int64_t leading_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

inline GeluApprox parse_gelu_approx(std::string_view approximate) {
  if (approximate == "none") return GeluApprox::kNone;
  if (approximate == "tanh") return GeluApprox::kTanh;
  TORCH_CHECK(false, "approximate must be 'none' or 'tanh', got '", approximate, "'");
}

inline void check_floating(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
              name, " must be float32, float64, float16 or bfloat16, got ", st);
}

inline void check_same_device_dtype(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                                    const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " is on ", a.device(), " but ", b_name, " is on ",
              b.device(), "; both must be on the same device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), a_name, " has dtype ", a.scalar_type(), " but ",
              b_name, " has dtype ", b.scalar_type(), "; they must match");
}

// `x` is [..., n] with n == size of the 1-D `bias`; returns n.
inline int64_t check_bias_matches_last_dim(const at::Tensor& x, const char* x_name,
                                           const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, x_name, " must have at least 1 dimension, got shape ", x.sizes());
  TORCH_CHECK(bias.dim() == 1, "bias must be 1-D, got shape ", bias.sizes());
  TORCH_CHECK(bias.size(0) == x.size(-1), "bias has ", bias.size(0), " elements but the last dim of ",
              x_name, " is ", x.size(-1), " (", x_name, " shape ", x.sizes(), "); they must match");
  return x.size(-1);
}

inline void check_device_type(const at::Tensor& t, const char* name, at::DeviceType expected,
                              const char* op) {
  TORCH_CHECK(t.device().type() == expected, "parallel_layers::", op, " (", expected,
              " kernel) got ", name, " on ", t.device());
}

// bias_gelu(x [..., n], bias [n]); returns n.
inline int64_t check_bias_gelu_args(const at::Tensor& x, const at::Tensor& bias,
                                    at::DeviceType expected) {
  check_floating(x, "x");
  check_same_device_dtype(x, "x", bias, "bias");
  check_device_type(x, "x", expected, "bias_gelu");
  return check_bias_matches_last_dim(x, "x", bias);
}

// bias_gelu_backward(grad_out [..., n], preact [..., n]); returns n.
inline int64_t check_bias_gelu_backward_args(const at::Tensor& grad_out, const at::Tensor& preact,
                                             at::DeviceType expected) {
  check_floating(preact, "preact");
  check_same_device_dtype(grad_out, "grad_out", preact, "preact");
  check_device_type(preact, "preact", expected, "bias_gelu_backward");
  TORCH_CHECK(grad_out.sizes() == preact.sizes(), "grad_out has shape ", grad_out.sizes(),
              " but preact has shape ", preact.sizes(), "; they must match");
  TORCH_CHECK(preact.dim() >= 1, "preact must have at least 1 dimension, got shape ", preact.sizes());
  return preact.size(-1);
}

struct LinearShape {
  int64_t m, k, n;  // x viewed as [m, k], weight [n, k]
};

// linear_gelu(x [..., k], weight [n, k], bias [n] or none); `op` names the caller in errors.
inline LinearShape check_linear_gelu_args(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, at::DeviceType expected,
                                          const char* op = "linear_gelu") {
  check_floating(x, "x");
  check_same_device_dtype(x, "x", weight, "weight");
  check_device_type(x, "x", expected, op);
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dimension, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D [out_features, in_features], got shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) == x.size(-1), "x has ", x.size(-1), " features in its last dim (shape ", x.sizes(),
              ") but weight expects in_features = ", weight.size(1), " (weight shape ", weight.sizes(), ")");
  if (bias) {
    check_same_device_dtype(x, "x", *bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must have shape [", weight.size(0),
                "] (out_features of weight ", weight.sizes(), "), got ", bias->sizes());
  }
  return LinearShape{leading_rows(x), x.size(-1), weight.size(0)};
}

// linear_gelu_backward(grad_y [..., n], x [..., k], weight [n, k], preact [..., n]): the
// forward's shapes, and grad_y shaped like its output.
inline LinearShape check_linear_gelu_backward_args(const at::Tensor& grad_y, const at::Tensor& x,
                                                   const at::Tensor& weight, const at::Tensor& preact,
                                                   at::DeviceType expected) {
  const LinearShape s = check_linear_gelu_args(x, weight, std::nullopt, expected);
  check_same_device_dtype(x, "x", grad_y, "grad_y");
  check_same_device_dtype(x, "x", preact, "preact");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = s.n;
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(out_shape) && preact.sizes() == at::IntArrayRef(out_shape),
              "linear_gelu_backward: grad_y ", grad_y.sizes(), " and preact ", preact.sizes(),
              " must both have the forward output's shape ", at::IntArrayRef(out_shape), " (x ", x.sizes(),
              ", weight ", weight.sizes(), ")");
  return s;
}

// linear_swiglu(x [..., k], weight [2n, k], bias [2n] or none): a linear layer's arguments with
// an even number of output rows, the gate rows stacked on the up rows; returns {m, k, 2n}.
inline LinearShape check_linear_swiglu_args(const at::Tensor& x, const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias, at::DeviceType expected) {
  const LinearShape s = check_linear_gelu_args(x, weight, bias, expected, "linear_swiglu");
  TORCH_CHECK(s.n % 2 == 0, "linear_swiglu: weight must be [2 * n, in_features], the n gate rows stacked on the n "
              "up rows, so its first dim must be even; got weight shape ", weight.sizes());
  return s;
}

// linear_swiglu_backward(grad_y [..., n], x [..., k], weight [2n, k], preact [..., 2n]): the
// forward's shapes, grad_y shaped like its output and preact like its packed pre-activation.
inline LinearShape check_linear_swiglu_backward_args(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& preact,
                                                     at::DeviceType expected) {
  const LinearShape s = check_linear_swiglu_args(x, weight, std::nullopt, expected);
  check_same_device_dtype(x, "x", grad_y, "grad_y");
  check_same_device_dtype(x, "x", preact, "preact");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end()), pre_shape = out_shape;
  out_shape.back() = s.n / 2;
  pre_shape.back() = s.n;
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(out_shape) && preact.sizes() == at::IntArrayRef(pre_shape),
              "linear_swiglu_backward: grad_y ", grad_y.sizes(), " must have the output's shape ",
              at::IntArrayRef(out_shape), " and preact ", preact.sizes(), " the pre-activation's shape ",
              at::IntArrayRef(pre_shape), " (x ", x.sizes(), ", weight ", weight.sizes(), ")");
  return s;
}

// swiglu_backward(grad_y [..., n], preact [..., 2n]): grad_y shaped like the output of the
// packed pre-activation preact; returns n.
inline int64_t check_swiglu_backward_args(const at::Tensor& grad_y, const at::Tensor& preact,
                                          at::DeviceType expected) {
  check_floating(preact, "preact");
  check_same_device_dtype(grad_y, "grad_y", preact, "preact");
  check_device_type(preact, "preact", expected, "swiglu_backward");
  TORCH_CHECK(preact.dim() >= 1 && preact.size(-1) % 2 == 0 && grad_y.dim() == preact.dim() &&
                  grad_y.sizes().slice(0, grad_y.dim() - 1) == preact.sizes().slice(0, preact.dim() - 1) &&
                  grad_y.size(-1) * 2 == preact.size(-1),
              "swiglu_backward: preact must be the packed pre-activation [..., 2n] (gate | up) and grad_y the "
              "output's gradient [..., n] with the same leading dims; got grad_y ", grad_y.sizes(), " and preact ",
              preact.sizes());
  return preact.size(-1) / 2;
}

// linear_input_grad(grad_out [..., n], weight [n, k]); returns {rows, k, n}.
inline LinearShape check_linear_input_grad_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                                at::DeviceType expected) {
  check_floating(weight, "weight");
  check_same_device_dtype(weight, "weight", grad_out, "grad_out");
  check_device_type(weight, "weight", expected, "linear_input_grad");
  TORCH_CHECK(weight.dim() == 2 && grad_out.dim() >= 1 && grad_out.size(-1) == weight.size(0),
              "linear_input_grad: grad_out [..., n] and weight [n, k] must agree on n; got grad_out ",
              grad_out.sizes(), " and weight ", weight.sizes());
  return LinearShape{leading_rows(grad_out), weight.size(1), weight.size(0)};
}

// linear_weight_grad(grad_out [..., n], x [..., k]): the same leading dims (the rows of the
// GEMM); returns {rows, k, n}.
inline LinearShape check_linear_weight_grad_args(const at::Tensor& grad_out, const at::Tensor& x,
                                                 at::DeviceType expected) {
  check_floating(x, "x");
  check_same_device_dtype(x, "x", grad_out, "grad_out");
  check_device_type(x, "x", expected, "linear_weight_grad");
  TORCH_CHECK(x.dim() >= 1 && grad_out.dim() >= 1, "linear_weight_grad: grad_out and x must have at least 1 "
              "dimension, got shapes ", grad_out.sizes(), " and ", x.sizes());
  TORCH_CHECK(grad_out.sizes().slice(0, grad_out.dim() - 1) == x.sizes().slice(0, x.dim() - 1),
              "linear_weight_grad: grad_out ", grad_out.sizes(), " and x ", x.sizes(),
              " must have the same leading dims (all but the last)");
  return LinearShape{leading_rows(x), x.size(-1), grad_out.size(-1)};
}

}  // namespace parallel_layers
