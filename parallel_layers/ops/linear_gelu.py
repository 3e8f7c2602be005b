"""Fused GEMM + bias + GeLU: `y = gelu(x @ weight.T + bias)`, for training and inference.

Shapes: x [..., K], weight [N, K], bias [N] or None -> y [..., N]. Dtypes: float32, float64,
bfloat16, float16 (all alike). Unlike `torch._addmm_activation`, the forward keeps the
pre-activation `x @ weight.T + bias` for backward, and skips writing it when no gradient
is needed. Backward (`linear_gelu_backward`) runs the fused dgelu + bias-gradient pass, then
only the GEMMs whose gradients are needed (`dx = dz @ W`, `dW = dz.T @ x`).

Its contracts are decided once, in C++ (docs/kernels.md): the weight gradient's operand layout
(Note [weight-gradient operand layout], csrc/linear_gelu.cpp) and the autocast policy
(csrc/autocast.cpp). A caller that writes its own autograd Function around the op - the
tensor-parallel column layer, which overlaps a collective with the weight-gradient GEMM -
composes `linear_autocast_inputs`, `linear_gelu_forward`, `bias_gelu_backward` and
`linear_weight_grad`, which follow the same two rules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallel_layers.ops._call import op_call
from parallel_layers.ops.bias_gelu import check_approximate

_LINEAR_GELU = op_call("linear_gelu")
_LINEAR_WEIGHT_GRAD = op_call("linear_weight_grad")
_LINEAR_INPUT_GRAD = op_call("linear_input_grad")
_LINEAR_FORWARD = op_call("linear_forward")
_LINEAR_AUTOCAST_INPUTS = op_call("linear_autocast_inputs")


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "tanh") -> Tensor:
    """Return `F.gelu(F.linear(x, weight, bias), approximate=approximate)` from one fused op."""
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    y, _ = _LINEAR_GELU(x, weight, bias, approximate, needs_grad)
    return y


def linear_gelu_forward(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str,
                        save_preact: bool) -> tuple[Tensor, Tensor]:
    """`(y, preact)`: y as `linear_gelu` returns it and, when save_preact, the pre-activation
    `x @ weight.T + bias` [..., N] that `bias_gelu_backward` takes (else an empty [0] tensor)."""
    return _LINEAR_GELU(x, weight, bias, approximate, save_preact)


def linear_weight_grad(grad_out: Tensor, x: Tensor) -> Tensor:
    """`grad_out^T @ x`: the weight gradient of `y = x @ weight.T` (+ bias, then any activation).

    grad_out [..., N] (the gradient of the pre-activation) and x [..., K] (the input) with the
    same leading dims and one dtype -> [N, K]. The GEMM gets its operands in the layout that
    `linear_gelu`'s own backward uses (a row-major grad_out^T for bfloat16 on CPU: Note
    [weight-gradient operand layout], csrc/linear_gelu.cpp), so for the same dz both give the
    same bits; 16-bit dtypes accumulate in float32 inside the GEMM. Not differentiable.
    """
    return _LINEAR_WEIGHT_GRAD(grad_out, x)


def linear_input_grad(grad_out: Tensor, weight: Tensor) -> Tensor:
    """`grad_out @ weight`: the input gradient of `y = x @ weight.T` (+ bias, then any activation).

    grad_out [..., N] (the gradient of the pre-activation) and weight [N, K], one dtype -> [..., K].
    The GEMM is the one `linear_gelu`'s and `linear_swiglu`'s own backward use for dx (on CPU in
    float32 possibly oneDNN's: Note [float32 GEMMs through oneDNN], csrc/gemm.cpp), so a backward
    split around a collective gives their bits. Not differentiable.
    """
    return _LINEAR_INPUT_GRAD(grad_out, weight)


def linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias`: `F.linear`'s value, by the GEMM rules of the fused ops' forward.

    x [..., K], weight [N, K], bias [N] or None, one dtype -> [..., N]. On CPU in float32 the
    GEMM is oneDNN's where Note [float32 GEMMs through oneDNN] says so, and in bfloat16 on a CPU
    without oneDNN bfloat16 a float32 product rounded once (Note [bfloat16 GEMM without oneDNN],
    csrc/gemm.cpp); elsewhere, and on CUDA, `F.linear`'s bits. The forward GEMM of the layers whose
    backward is their own (`linear_input_grad`, `linear_weight_grad`). Not differentiable.
    """
    return _LINEAR_FORWARD(x, weight, bias)


def linear_autocast_inputs(x: Tensor, weight: Tensor,
                           bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(x, weight, bias)` as `linear_gelu` computes with them under the current autocast state.

    Inside `torch.autocast` (CPU or CUDA): each cast to the autocast dtype, as `F.linear`'s
    inputs are (float64 stays float64), by differentiable casts that autocast caches for the
    region; outside it: the tensors themselves. For callers that run `linear_gelu_forward` or
    `F.linear` inside an autograd Function of their own: cast before the Function, it saves and
    computes in that dtype, so its backward also runs after the autocast region has closed,
    and float32 parameters get float32 gradients. The policy is the op's (csrc/autocast.cpp).
    """
    return _LINEAR_AUTOCAST_INPUTS(x, weight, bias)


@torch.library.register_fake("parallel_layers::linear_gelu")
def _linear_gelu_fake(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str,
                      save_preact: bool) -> tuple[Tensor, Tensor]:
    check_approximate(approximate)
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match: weight must be "
                         "[out_features, in_features] with in_features the last dim of x")
    torch._check(bias is None or tuple(bias.shape) == (weight.shape[0],),
                 lambda: f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    out_shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(out_shape), x.new_empty(out_shape if save_preact else (0,))


@torch.library.register_fake("parallel_layers::linear_gelu_backward")
def _linear_gelu_backward_fake(grad_y: Tensor, x: Tensor, weight: Tensor, preact: Tensor, approximate: str,
                               output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    check_approximate(approximate)
    out_shape = (*x.shape[:-1], weight.shape[0])
    torch._check(tuple(grad_y.shape) == out_shape and tuple(preact.shape) == out_shape,
                 lambda: f"linear_gelu_backward: grad_y {tuple(grad_y.shape)} and preact {tuple(preact.shape)} "
                         f"must both have the forward output's shape {out_shape}")
    need_dx, need_dw, need_db = output_mask
    return (x.new_empty(x.shape if need_dx else (0,)),
            x.new_empty(weight.shape if need_dw else (0,)),
            x.new_empty((weight.shape[0],) if need_db else (0,)))


@torch.library.register_fake("parallel_layers::linear_weight_grad")
def _linear_weight_grad_fake(grad_out: Tensor, x: Tensor) -> Tensor:
    torch._check(grad_out.dim() >= 1 and x.dim() >= 1 and grad_out.shape[:-1] == x.shape[:-1],
                 lambda: f"linear_weight_grad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} must have "
                         "the same leading dims (all but the last)")
    return x.new_empty((grad_out.shape[-1], x.shape[-1]))


@torch.library.register_fake("parallel_layers::linear_forward")
def _linear_forward_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: f"linear_forward: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match: weight "
                         "must be [out_features, in_features] with in_features the last dim of x")
    torch._check(bias is None or tuple(bias.shape) == (weight.shape[0],),
                 lambda: f"linear_forward: bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("parallel_layers::linear_input_grad")
def _linear_input_grad_fake(grad_out: Tensor, weight: Tensor) -> Tensor:
    torch._check(weight.dim() == 2 and grad_out.dim() >= 1 and grad_out.shape[-1] == weight.shape[0],
                 lambda: f"linear_input_grad: grad_out [..., n] and weight [n, k] must agree on n; got grad_out "
                         f"{tuple(grad_out.shape)} and weight {tuple(weight.shape)}")
    return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))


# Autograd: a C++ kernel at the Autograd key (csrc/autograd.cpp, Note [autograd in C++]).
