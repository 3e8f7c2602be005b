"""Fused bias-add + GeLU: `y = gelu(x + bias)`, with the pre-activation kept for backward.

Shapes: x [..., n], bias [n] -> y [..., n]. Dtypes: float32, float64, float16, bfloat16 (x and
bias alike); math in float32 (float64 for float64 inputs). Backward is one fused op too
(`bias_gelu_backward`: dgelu and the bias gradient in one pass over the data).
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallel_layers.ops._call import op_call

_BIAS_GELU = op_call("bias_gelu")
_BIAS_GELU_BACKWARD = op_call("bias_gelu_backward")

_APPROXIMATIONS = ("none", "tanh")


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """Return `gelu(x + bias, approximate=approximate)` from one fused kernel.

    Same result as `torch.nn.functional.gelu(x + bias, approximate=approximate)`; the forward
    also writes the pre-activation `x + bias`, which backward reads instead of recomputing.
    """
    y, _ = _BIAS_GELU(x, bias, approximate)
    return y


def bias_gelu_backward(grad_out: Tensor, preact: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    """`(dz, dbias)`: dz = grad_out * gelu'(preact) and dbias = dz summed over all leading dims,
    from one pass over the data.

    grad_out and preact [..., n] of one dtype -> dz [..., n], dbias [n]. dbias sums the values of
    dz as rounded to their dtype, in float32 (float64 for float64), and is rounded once. Not
    differentiable; for callers that write a backward of their own (the tensor-parallel column
    layer, which then hands dz to `linear_weight_grad`).
    """
    return _BIAS_GELU_BACKWARD(grad_out, preact, approximate)


def check_approximate(approximate: str) -> None:
    """Raise (also while tracing) unless approximate is 'none' or 'tanh'."""
    torch._check(approximate in _APPROXIMATIONS,
                 lambda: f"approximate must be 'none' or 'tanh', got {approximate!r}")


@torch.library.register_fake("parallel_layers::bias_gelu")
def _bias_gelu_fake(x: Tensor, bias: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    check_approximate(approximate)
    torch._check(bias.dim() == 1 and x.dim() >= 1 and bias.shape[0] == x.shape[-1],
                 lambda: f"bias of shape {tuple(bias.shape)} must be [n] with n the last dim of x {tuple(x.shape)}")
    # The kernels return contiguous tensors whatever the strides of x.
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake("parallel_layers::bias_gelu_backward")
def _bias_gelu_backward_fake(grad_out: Tensor, preact: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    check_approximate(approximate)
    torch._check(grad_out.shape == preact.shape,
                 lambda: f"grad_out has shape {tuple(grad_out.shape)} but preact has {tuple(preact.shape)}")
    return preact.new_empty(preact.shape), preact.new_empty(preact.shape[-1:])


# Autograd: a C++ kernel at the Autograd key (csrc/autograd.cpp, Note [autograd in C++]).
