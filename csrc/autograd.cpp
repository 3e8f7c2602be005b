// Autograd kernels of the differentiable ops, in C++.
//
// Note [autograd in C++]: each op's backward is a torch::autograd::Function registered at the
// Autograd dispatch key, as ATen's own ops have theirs, rather than torch.library's
// register_autograd. That one runs a Python autograd.Function per call (plus argument
// re-binding and checks of the backward's results), and on a GPU it was the larger part of a
// fused op's cost at ordinary sizes: on an H200 a bfloat16 linear_gelu forward + backward at
// 2048 x 1024 -> 4096 had ~0.12 ms of GPU work and took 0.72 ms of wall clock, eager's 0.42
// (benchmarks/results/2026-11-26-h200.md). Here the forward re-dispatches below autograd to
// the CPU / CUDA kernel and saves what backward needs; backward calls the backward ops through
// the dispatcher, so CPU and CUDA, autocast's casts (applied before this kernel) and
// torch.compile's tracing (the fake kernels in parallel_layers/ops) all see ordinary op calls.
// The backward ops themselves are not differentiable (no double backward): Note [ops without a
// derivative] below.
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace parallel_layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor grad_if(AutogradContext* ctx, size_t input, const at::Tensor& grad) {
  return ctx->needs_input_grad(input) ? grad : at::Tensor();
}

using OptTensor = std::optional<at::Tensor>;
using Mask = std::array<bool, 3>;
using Pair = std::tuple<at::Tensor, at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Ref = const at::Tensor&;  // in the signatures below

// An op of this library as the dispatcher has it, by name and C++ signature.
template <typename Signature>
struct TypedOp;
template <typename R, typename... Args>
struct TypedOp<R(Args...)> {
  c10::TypedOperatorHandle<R(Args...)> handle;
  explicit TypedOp(const char* name)
      : handle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<R(Args...)>()) {}
  R call(Args... args) const { return handle.call(args...); }
};

// The ops the autograd kernels call (their schemas: csrc/registration.cpp).
struct Ops {
  TypedOp<Pair(Ref, Ref, std::string_view)> bias_gelu{"parallel_layers::bias_gelu"};
  TypedOp<Pair(Ref, Ref, std::string_view)> bias_gelu_backward{"parallel_layers::bias_gelu_backward"};
  TypedOp<Pair(Ref, Ref, const OptTensor&, std::string_view, bool)> linear_gelu{"parallel_layers::linear_gelu"};
  TypedOp<Triple(Ref, Ref, Ref, Ref, std::string_view, Mask)> linear_gelu_backward{
      "parallel_layers::linear_gelu_backward"};
  TypedOp<Pair(Ref, Ref, const OptTensor&, bool)> linear_swiglu{"parallel_layers::linear_swiglu"};
  TypedOp<Triple(Ref, Ref, Ref, Ref, Mask)> linear_swiglu_backward{"parallel_layers::linear_swiglu_backward"};
  TypedOp<Pair(Ref, Ref, bool)> swiglu_backward{"parallel_layers::swiglu_backward"};
  TypedOp<at::Tensor(Ref, Ref)> linear_input_grad{"parallel_layers::linear_input_grad"};
  TypedOp<at::Tensor(Ref, Ref)> linear_weight_grad{"parallel_layers::linear_weight_grad"};
  TypedOp<Pair(Ref, Ref, double)> rms_norm{"parallel_layers::rms_norm"};
  TypedOp<Triple(Ref, Ref, Ref, double)> rms_norm_add{"parallel_layers::rms_norm_add"};
  TypedOp<Pair(Ref, Ref, Ref, Ref, const OptTensor&)> rms_norm_backward{"parallel_layers::rms_norm_backward"};
  TypedOp<at::Tensor(Ref)> transpose_2d{"parallel_layers::transpose_2d"};
  TypedOp<at::Tensor(Ref, Ref, const OptTensor&)> linear_forward{"parallel_layers::linear_forward"};
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

bool has_forward_grad(const at::Tensor& t) { return torch::autograd::isFwGradDefined(t); }
bool has_forward_grad(const OptTensor& t) { return torch::autograd::isFwGradDefined(t); }
template <typename T>
bool has_forward_grad(const T&) { return false; }

bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const OptTensor& t) { return t.has_value() && requires_grad(*t); }
template <typename T>
bool requires_grad(const T&) { return false; }

// Note [no autograd node without a graph to record]: torch::autograd::Function::apply builds its
// node - the context, its saved-data map, a SavedVariable per saved tensor, the outputs' wrapping
// - on every call, whether or not any gradient will be asked for. Under torch.no_grad, or on
// inputs none of which requires grad (inference, frozen layers, the forward of an evaluation
// pass), that is all waste, so the differentiable ops' autograd kernels below first ask whether
// a graph would be recorded, as ATen's generated autograd kernels do, and otherwise run the op
// below autograd directly. Dual tensors (forward-mode AD) still take the Function, which rejects
// them (the C++ Function has no jvp). One visible difference: Function::apply also refuses to
// run under functorch's transforms (torch.func.grad, vmap, jvp), and the direct path does not
// ask. So an op whose inputs do not depend on the transformed argument, a constant to the
// transform, now runs, and one whose inputs do still raises (tests/ops/test_autograd.py).
template <typename... Args>
bool records_graph(const Args&... args) {
  return (has_forward_grad(args) || ...) ||
         (torch::autograd::GradMode::is_enabled() && (requires_grad(args) || ...));
}

// The op with the dispatcher's autograd keys skipped: the CPU / CUDA kernel (or autocast's).
template <typename R, typename... Args>
R below_autograd(const TypedOp<R(Args...)>& op, std::type_identity_t<Args>... args) {
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(args...);
}

// Sizes through sym_* throughout: under torch.compile with dynamic shapes they are symbolic.
bool defined_nonempty(const at::Tensor& t) { return t.defined() && t.sym_numel() != 0; }

// t [..., n] as a matrix [rows, n] (a 1-D t: one row). flatten, not reshape({-1, n}): with an
// empty last dimension the -1 is ambiguous ("cannot reshape tensor of 0 elements" for [3, 0]).
at::Tensor as_rows(const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t.flatten(0, -2); }

// dz [..., n] summed over all leading dims -> [n] (ATen's sum: its order may depend on the
// thread count, unlike the fused backwards' dbias, docs/kernels.md).
at::Tensor sum_rows(const at::Tensor& dz) { return as_rows(dz).sum(0); }

// (dx, dweight, dbias) of x @ weight^T + bias from the pre-activation's gradient dz, each only
// when asked, by the fused ops' GEMM rules (linear_input_grad / linear_weight_grad): the path of
// a backward whose pre-activation output was itself used downstream.
Triple linear_grads(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& weight, Mask mask) {
  const at::Tensor dz2 = as_rows(dz);
  at::Tensor dx = mask[0] ? ops().linear_input_grad.call(dz2, weight).view_symint(x.sym_sizes()) : at::Tensor();
  at::Tensor dw = mask[1] ? ops().linear_weight_grad.call(dz2, as_rows(x)) : at::Tensor();
  at::Tensor db = mask[2] ? dz2.sum(0) : at::Tensor();
  return {dx, dw, db};
}

// Whether t has the shape of x @ weight^T: [..., weight.size(0)] (a pre-activation that was kept).
bool has_linear_output_shape(const at::Tensor& t, const at::Tensor& x, const at::Tensor& weight) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = weight.sym_size(0);
  return t.sym_sizes() == c10::SymIntArrayRef(shape);
}

// Which of (x, weight, bias) of a linear op need gradients; bias is an input edge only when given.
Mask linear_mask(AutogradContext* ctx, const at::Tensor& bias) {
  return {ctx->needs_input_grad(0), ctx->needs_input_grad(1), bias.defined() && ctx->needs_input_grad(2)};
}

// The backward of a linear op with an activation epilogue (linear_gelu, linear_swiglu), whose
// forward saved (x, weight, bias or undefined, preact) and whose outputs are (y, preact).
// fused(grad_y, x, weight, preact, mask) is its fused backward op; epilogue(grad_y, preact) the
// activation's gradient alone (d_preact). Returns one gradient per forward input (num_inputs).
template <typename Fused, typename Epilogue>
variable_list linear_activation_backward(AutogradContext* ctx, const variable_list& grads, size_t num_inputs,
                                         Fused fused, Epilogue epilogue) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
  at::Tensor preact = saved[3];
  if (!has_linear_output_shape(preact, x, weight)) {
    // Called directly with save_preact = false under autograd: recompute what was not kept.
    preact = at::linear(x, weight, bias.defined() ? OptTensor(bias) : std::nullopt);
  }
  const Mask mask = linear_mask(ctx, bias);
  const at::Tensor &grad_y = grads[0], &grad_preact = grads[1];
  variable_list out(num_inputs);
  at::Tensor dx, dw, db;
  if (!defined_nonempty(grad_preact)) {
    if (!grad_y.defined()) return out;
    std::tie(dx, dw, db) = fused(grad_y, x, weight, preact, mask);
  } else {
    // The pre-activation output was used itself (only by callers of the raw op): its gradient
    // adds to d_preact, so d_preact is formed here and the GEMMs run on the sum.
    at::Tensor d_preact = grad_preact;
    if (grad_y.defined()) d_preact = d_preact + epilogue(grad_y, preact);
    std::tie(dx, dw, db) = linear_grads(d_preact, x, weight, mask);
  }
  if (mask[0]) out[0] = dx;
  if (mask[1]) out[1] = dw;
  if (mask[2]) out[2] = db;
  return out;
}

// ---- bias_gelu(x, bias, approximate) -> (y, z): z, the pre-activation, is differentiable too.

struct BiasGeluFunction : torch::autograd::Function<BiasGeluFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                               std::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, z] = ops().bias_gelu.call(x, bias, approximate);
    ctx->save_for_backward({z});
    ctx->saved_data["approximate"] = std::string(approximate);
    // Unused outputs (almost always z) arrive undefined, not as zeros to add.
    ctx->set_materialize_grads(false);
    return {y, z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad_y = grads[0];
    const at::Tensor& grad_z = grads[1];
    const at::Tensor z = ctx->get_saved_variables()[0];
    at::Tensor dz, dbias;
    if (grad_y.defined()) {
      std::tie(dz, dbias) = ops().bias_gelu_backward.call(grad_y, z, ctx->saved_data["approximate"].toStringRef());
    }
    if (grad_z.defined()) {  // the pre-activation itself was used downstream
      dz = dz.defined() ? dz + grad_z : grad_z;
      dbias = sum_rows(dz);
    }
    return {dz, grad_if(ctx, 1, dbias), at::Tensor()};
  }
};

// ---- linear_gelu(x, weight, bias?, approximate, save_preact) -> (y, preact)

struct LinearGeluFunction : torch::autograd::Function<LinearGeluFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, std::string_view approximate, bool save_preact) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, preact] = ops().linear_gelu.call(x, weight, bias, approximate, save_preact);
    ctx->save_for_backward({x, weight, bias.value_or(at::Tensor()), preact});
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->set_materialize_grads(false);
    return {y, preact};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    return linear_activation_backward(
        ctx, grads, /*num_inputs=*/5,
        [&](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& z, Mask mask) {
          return ops().linear_gelu_backward.call(dy, x, w, z, approximate, mask);
        },
        [&](const at::Tensor& dy, const at::Tensor& z) {
          return std::get<0>(ops().bias_gelu_backward.call(dy, z, approximate));
        });
  }
};

// ---- linear_swiglu(x, weight [2n, k], bias?, save_preact) -> (y, preact [.., 2n])

struct LinearSwigluFunction : torch::autograd::Function<LinearSwigluFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, bool save_preact) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, preact] = ops().linear_swiglu.call(x, weight, bias, save_preact);
    ctx->save_for_backward({x, weight, bias.value_or(at::Tensor()), preact});
    ctx->set_materialize_grads(false);
    return {y, preact};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linear_activation_backward(
        ctx, grads, /*num_inputs=*/4,
        [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& z, Mask mask) {
          return ops().linear_swiglu_backward.call(dy, x, w, z, mask);
        },
        [](const at::Tensor& dy, const at::Tensor& z) {
          return std::get<0>(ops().swiglu_backward.call(dy, z, false));
        });
  }
};

// ---- rms_norm(x, weight, eps) -> (y, rstd); rstd is saved for backward, not differentiable.

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] = ops().rms_norm.call(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [dx, dweight] = ops().rms_norm_backward.call(grads[0], saved[0], saved[1], saved[2], std::nullopt);
    return {grad_if(ctx, 0, dx), grad_if(ctx, 1, dweight), at::Tensor()};
  }
};

// ---- rms_norm_add(x, residual, weight, eps) -> (y, sum, rstd): the norm of sum = x + residual.

struct RmsNormAddFunction : torch::autograd::Function<RmsNormAddFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, sum, rstd] = ops().rms_norm_add.call(x, residual, weight, eps);
    ctx->save_for_backward({sum, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    // An unused output's gradient arrives undefined, not as zeros to add.
    ctx->set_materialize_grads(false);
    return {y, sum, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor &grad_y = grads[0], &grad_sum = grads[1];
    if (!grad_y.defined()) {  // only the sum was used
      const at::Tensor ds = grad_sum.defined() ? grad_sum : at::zeros_like(sum);
      return {ds, ds, ctx->needs_input_grad(2) ? at::zeros_like(weight) : at::Tensor(), at::Tensor()};
    }
    const OptTensor dsum = grad_sum.defined() ? OptTensor(grad_sum) : std::nullopt;
    auto [ds, dweight] = ops().rms_norm_backward.call(grad_y, sum, weight, rstd, dsum);
    return {ds, ds, grad_if(ctx, 2, dweight), at::Tensor()};
  }
};

// ---- transpose_2d(x) -> x^T contiguous; its gradient is the transpose of the gradient.

struct Transpose2dFunction : torch::autograd::Function<Transpose2dFunction> {
  static variable_list forward(AutogradContext*, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView below;
    return {ops().transpose_2d.call(x)};
  }

  static variable_list backward(AutogradContext*, variable_list grads) { return {ops().transpose_2d.call(grads[0])}; }
};

// ---- Note [ops without a derivative]: the backward ops, and linear_forward (the forward GEMM of
// the tensor-parallel layers, whose own autograd Functions give its gradients), are not
// differentiable. With no kernel of theirs at the Autograd key the dispatcher's fallback ran them,
// which (1) boxed every call's arguments into a stack and back, ~1.3 us of host time per call in
// a small linear_gelu backward (perf), paid by every backward op of every layer on a GPU too, and
// (2) when a graph was recorded through one - torch.autograd.grad(..., create_graph=True) through
// a fused op, or a direct call on tensors that require grad - gave its outputs a node that only
// warns when backpropagated through: the second-order gradient came back as None. Now each has a
// typed kernel: the op below autograd and, only when a graph would be recorded (grad mode on and
// an input that requires grad), an Error node on its outputs, so that backpropagating through
// them raises, naming the op. A dual tensor (forward-mode AD) among the inputs raises at once;
// run below autograd, the op would hand back no tangent, i.e. a silent zero. Under torch.compile
// a direct call on tensors that require grad fails when compiling, since AOTAutograd traces the
// backward ahead of time - as for ATen ops whose derivative is not implemented.

void collect_tensor(variable_list& out, const at::Tensor& t) { out.push_back(t); }
void collect_tensor(variable_list& out, const OptTensor& t) { out.push_back(t.value_or(at::Tensor())); }
template <typename T>
void collect_tensor(variable_list&, const T&) {}

// The pointer an autograd graph holds its nodes by: std::shared_ptr up to torch 2.11 (the torch of
// the GPU images this was run on), c10::intrusive_ptr in later releases. Taken from Edge so that
// one source builds against both.
using NodePtr = decltype(torch::autograd::Edge::function);

// N is a template parameter so that only the branch of the installed torch is instantiated.
template <typename N, typename... A>
NodePtr make_node(A&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>(std::forward<A>(args)...);
  } else {
    return c10::make_intrusive<N>(std::forward<A>(args)...);
  }
}

void set_error_history(const at::Tensor& t, const NodePtr& node) { torch::autograd::set_history(t, node); }
template <typename... Ts>
void set_error_history(const std::tuple<Ts...>& outputs, const NodePtr& node) {
  std::apply([&](const auto&... t) { (torch::autograd::set_history(t, node), ...); }, outputs);
}

template <typename R, typename... Args>
R without_derivative(const char* name, const TypedOp<R(Args...)>& op, std::type_identity_t<Args>... args) {
  // Forward-mode AD (dual tensors, torch.func.jvp) would otherwise get no tangent: a silent zero.
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_forward_grad(args) || ...), name,
                              " has no forward-mode derivative (dual tensors, torch.func.jvp): the fused ops and "
                              "their backward ops support reverse mode only");
  const bool record = torch::autograd::GradMode::is_enabled() && (requires_grad(args) || ...);
  R out = below_autograd(op, args...);
  if (record) {
    variable_list inputs;
    (collect_tensor(inputs, args), ...);
    auto node = make_node<torch::autograd::Error>(
        std::string(name) +
            " has no derivative: parallel_layers differentiates its fused ops to first order only (their "
            "backward ops, and linear_forward, which the tensor-parallel layers differentiate themselves, are not "
            "differentiable). Backpropagating through it needs a second-order gradient (create_graph=True through "
            "a fused op) or comes from calling it directly on tensors that require grad; use the eager ops "
            "(F.linear, F.gelu, F.silu, the model's own RMSNorm) where higher-order gradients are needed.",
        torch::autograd::collect_next_edges(inputs));
    set_error_history(out, node);
  }
  return out;
}

Triple linear_gelu_backward_autograd(Ref grad_y, Ref x, Ref weight, Ref preact, std::string_view approximate,
                                     Mask mask) {
  return without_derivative("parallel_layers::linear_gelu_backward", ops().linear_gelu_backward, grad_y, x, weight,
                            preact, approximate, mask);
}

Triple linear_swiglu_backward_autograd(Ref grad_y, Ref x, Ref weight, Ref preact, Mask mask) {
  return without_derivative("parallel_layers::linear_swiglu_backward", ops().linear_swiglu_backward, grad_y, x,
                            weight, preact, mask);
}

Pair bias_gelu_backward_autograd(Ref grad_out, Ref preact, std::string_view approximate) {
  return without_derivative("parallel_layers::bias_gelu_backward", ops().bias_gelu_backward, grad_out, preact,
                            approximate);
}

Pair swiglu_backward_autograd(Ref grad_y, Ref preact, bool need_dbias) {
  return without_derivative("parallel_layers::swiglu_backward", ops().swiglu_backward, grad_y, preact, need_dbias);
}

at::Tensor linear_input_grad_autograd(Ref grad_out, Ref weight) {
  return without_derivative("parallel_layers::linear_input_grad", ops().linear_input_grad, grad_out, weight);
}

at::Tensor linear_weight_grad_autograd(Ref grad_out, Ref x) {
  return without_derivative("parallel_layers::linear_weight_grad", ops().linear_weight_grad, grad_out, x);
}

at::Tensor linear_forward_autograd(Ref x, Ref weight, const OptTensor& bias) {
  return without_derivative("parallel_layers::linear_forward", ops().linear_forward, x, weight, bias);
}

Pair rms_norm_backward_autograd(Ref grad_y, Ref x, Ref weight, Ref rstd, const OptTensor& grad_sum) {
  return without_derivative("parallel_layers::rms_norm_backward", ops().rms_norm_backward, grad_y, x, weight, rstd,
                            grad_sum);
}

Pair bias_gelu_autograd(const at::Tensor& x, const at::Tensor& bias, std::string_view approximate) {
  if (!records_graph(x, bias)) return below_autograd(ops().bias_gelu, x, bias, approximate);
  const variable_list out = BiasGeluFunction::apply(x, bias, approximate);
  return {out[0], out[1]};
}

Pair linear_gelu_autograd(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                          std::string_view approximate, bool save_preact) {
  if (!records_graph(x, weight, bias)) {  // Note [no autograd node without a graph to record]
    return below_autograd(ops().linear_gelu, x, weight, bias, approximate, save_preact);
  }
  const variable_list out = LinearGeluFunction::apply(x, weight, bias, approximate, save_preact);
  return {out[0], out[1]};
}

Pair linear_swiglu_autograd(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, bool save_preact) {
  if (!records_graph(x, weight, bias)) return below_autograd(ops().linear_swiglu, x, weight, bias, save_preact);
  const variable_list out = LinearSwigluFunction::apply(x, weight, bias, save_preact);
  return {out[0], out[1]};
}

Pair rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!records_graph(x, weight)) return below_autograd(ops().rms_norm, x, weight, eps);
  const variable_list out = RmsNormFunction::apply(x, weight, eps);
  return {out[0], out[1]};
}

Triple rms_norm_add_autograd(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  if (!records_graph(x, residual, weight)) return below_autograd(ops().rms_norm_add, x, residual, weight, eps);
  const variable_list out = RmsNormAddFunction::apply(x, residual, weight, eps);
  return {out[0], out[1], out[2]};
}

at::Tensor transpose_2d_autograd(const at::Tensor& x) {
  if (!records_graph(x)) return below_autograd(ops().transpose_2d, x);
  return Transpose2dFunction::apply(x)[0];
}

}  // namespace
}  // namespace parallel_layers

TORCH_LIBRARY_IMPL(parallel_layers, Autograd, m) {
  m.impl("bias_gelu", &parallel_layers::bias_gelu_autograd);
  m.impl("linear_gelu", &parallel_layers::linear_gelu_autograd);
  m.impl("linear_swiglu", &parallel_layers::linear_swiglu_autograd);
  m.impl("rms_norm", &parallel_layers::rms_norm_autograd);
  m.impl("rms_norm_add", &parallel_layers::rms_norm_add_autograd);
  m.impl("transpose_2d", &parallel_layers::transpose_2d_autograd);
  // Note [ops without a derivative]
  m.impl("bias_gelu_backward", &parallel_layers::bias_gelu_backward_autograd);
  m.impl("linear_gelu_backward", &parallel_layers::linear_gelu_backward_autograd);
  m.impl("linear_swiglu_backward", &parallel_layers::linear_swiglu_backward_autograd);
  m.impl("swiglu_backward", &parallel_layers::swiglu_backward_autograd);
  m.impl("linear_input_grad", &parallel_layers::linear_input_grad_autograd);
  m.impl("linear_weight_grad", &parallel_layers::linear_weight_grad_autograd);
  m.impl("linear_forward", &parallel_layers::linear_forward_autograd);
  m.impl("rms_norm_backward", &parallel_layers::rms_norm_backward_autograd);
}
