// Autocast kernels: the one statement of the library's autocast policy. Inside torch.autocast,
// linear_gelu runs in the autocast dtype, as F.linear does (autocast's "lower precision" list),
// so a model that swaps nn.Linear + GeLU for it keeps its mixed-precision behaviour; linear_swiglu
// (one packed linear layer and SwiGLU) follows the same policy. Without
// these kernels the op would run in whatever dtype its inputs have - float32 parameters meant
// a float32 GEMM, silently.
//
// The casts go through ATen's autocast cache (cached_cast), like the built-in ops: a float32
// parameter used several times in one autocast region is cast once; float64 and non-floating
// tensors are left alone. They happen before the autograd kernel, so autograd records them and
// the parameters' gradients come back in their own dtype. linear_autocast_inputs hands out
// the same casts (cast_linear_inputs) to callers that run linear_gelu or F.linear inside an
// autograd Function of their own - the tensor-parallel layers: cast before the Function, the
// Function saves and computes in the autocast dtype, so its backward also runs after the
// region has closed (where PyTorch's AMP recipe runs it). Outside autocast that op returns
// its inputs (its CompositeImplicitAutograd kernel, below).
//
// bias_gelu is elementwise, so it gets no lower-precision cast: what it gets is the promotion
// that x + bias has in eager. Under autocast the activation is typically 16-bit (the output of
// an autocast linear) while the bias parameter is float32; F.gelu(x + bias) then computes in
// float32, and so does bias_gelu (outside autocast, mixed dtypes are still an error). Its
// backward ops see the forward's one dtype and need no kernel here.
#include <optional>
#include <string_view>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace parallel_layers {
namespace {

using LinearInputs = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>>;

// The policy for a linear layer's inputs: each in the autocast dtype, through the cache (see
// the file comment). Called with this device's autocast key excluded.
template <c10::DeviceType kDevice>
LinearInputs cast_linear_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  return {at::autocast::cached_cast(dtype, x, kDevice), at::autocast::cached_cast(dtype, weight, kDevice),
          at::autocast::cached_cast(dtype, bias, kDevice)};
}

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> linear_gelu_autocast(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias,
                                                        std::string_view approximate, bool save_preact) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("parallel_layers::linear_gelu", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, std::string_view, bool)>();
  const auto [x_cast, weight_cast, bias_cast] = cast_linear_inputs<kDevice>(x, weight, bias);
  return op.call(x_cast, weight_cast, bias_cast, approximate, save_preact);
}

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> linear_swiglu_autocast(const at::Tensor& x, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias, bool save_preact) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("parallel_layers::linear_swiglu", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const std::optional<at::Tensor>&, bool)>();
  const auto [x_cast, weight_cast, bias_cast] = cast_linear_inputs<kDevice>(x, weight, bias);
  return op.call(x_cast, weight_cast, bias_cast, save_preact);
}

// linear_forward: F.linear's autocast policy (the inputs cast to the autocast dtype).
template <c10::DeviceType kDevice>
at::Tensor linear_forward_autocast(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("parallel_layers::linear_forward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  const auto [x_cast, weight_cast, bias_cast] = cast_linear_inputs<kDevice>(x, weight, bias);
  return op.call(x_cast, weight_cast, bias_cast);
}

template <c10::DeviceType kDevice>
LinearInputs linear_autocast_inputs_autocast(const at::Tensor& x, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  return cast_linear_inputs<kDevice>(x, weight, bias);
}

// Outside autocast (and on devices without an autocast kernel here): the inputs themselves.
LinearInputs linear_autocast_inputs(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
  return {x, weight, bias};
}

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> bias_gelu_autocast(const at::Tensor& x, const at::Tensor& bias,
                                                      std::string_view approximate) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("parallel_layers::bias_gelu", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       std::string_view)>();
  if (!x.is_floating_point() || !bias.is_floating_point()) return op.call(x, bias, approximate);  // its error
  const at::ScalarType dtype = at::promote_types(x.scalar_type(), bias.scalar_type());
  return op.call(x.to(dtype), bias.to(dtype), approximate);
}

}  // namespace
}  // namespace parallel_layers

TORCH_LIBRARY_IMPL(parallel_layers, AutocastCPU, m) {
  m.impl("linear_gelu", &parallel_layers::linear_gelu_autocast<c10::DeviceType::CPU>);
  m.impl("linear_swiglu", &parallel_layers::linear_swiglu_autocast<c10::DeviceType::CPU>);
  m.impl("linear_forward", &parallel_layers::linear_forward_autocast<c10::DeviceType::CPU>);
  m.impl("linear_autocast_inputs", &parallel_layers::linear_autocast_inputs_autocast<c10::DeviceType::CPU>);
  m.impl("bias_gelu", &parallel_layers::bias_gelu_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(parallel_layers, AutocastCUDA, m) {
  m.impl("linear_gelu", &parallel_layers::linear_gelu_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_swiglu", &parallel_layers::linear_swiglu_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_forward", &parallel_layers::linear_forward_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_autocast_inputs", &parallel_layers::linear_autocast_inputs_autocast<c10::DeviceType::CUDA>);
  m.impl("bias_gelu", &parallel_layers::bias_gelu_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(parallel_layers, CompositeImplicitAutograd, m) {
  m.impl("linear_autocast_inputs", &parallel_layers::linear_autocast_inputs);
}
