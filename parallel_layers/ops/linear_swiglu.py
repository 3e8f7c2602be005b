"""Fused linear + SwiGLU: `y = silu(x @ Wg.T + bg) * (x @ Wu.T + bu)` from one packed GEMM.

Shapes: x [..., K], weight [2N, K] with the gate rows `Wg` in [0, N) stacked on the up rows `Wu`
in [N, 2N), bias [2N] or None -> y [..., N]. Dtypes: float32, float64, bfloat16, float16. The
packed layout is also the per-rank weight of a column-parallel packed layer (each rank holds its
gate shard stacked on its up shard), so the op runs unchanged under tensor parallelism.

The forward keeps the packed pre-activation `[gate | up]` [..., 2N] for backward only when a
gradient is needed. Backward (`linear_swiglu_backward`) writes `d_gate = dy * up * silu'(gate)`
and `d_up = dy * silu(gate)` and sums the bias gradient in one pass over it, then runs only the
GEMMs whose gradients are needed (`dx = d_pre @ W`, `dW = d_pre.T @ x`, with linear_gelu's
operand-layout rule). What rounds where: docs/kernels.md; autocast: csrc/autocast.cpp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallel_layers.ops._call import op_call

_LINEAR_SWIGLU = op_call("linear_swiglu")
_SWIGLU_BACKWARD = op_call("swiglu_backward")


def linear_swiglu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Return `F.silu(gate) * up` for `gate, up = F.linear(x, weight, bias).chunk(2, -1)`, fused."""
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    y, _ = _LINEAR_SWIGLU(x, weight, bias, needs_grad)
    return y


def linear_swiglu_forward(x: Tensor, weight: Tensor, bias: Tensor | None,
                          save_preact: bool) -> tuple[Tensor, Tensor]:
    """`(y, preact)`: y as `linear_swiglu` returns it and, when save_preact, the packed
    pre-activation [..., 2N] that `swiglu_backward` takes (else an empty [0] tensor)."""
    return _LINEAR_SWIGLU(x, weight, bias, save_preact)


def swiglu_backward(grad_y: Tensor, preact: Tensor, need_dbias: bool = True) -> tuple[Tensor, Tensor | None]:
    """`(d_preact, dbias)`: `linear_swiglu_backward`'s epilogue alone - d_gate | d_up [..., 2N]
    from grad_y [..., N] and the saved pre-activation, and the bias gradient [2N] summed over
    the rows in the same pass (None unless need_dbias) - for callers that run the GEMMs
    themselves (the tensor-parallel layer overlaps its input-gradient collective with dW)."""
    d_pre, dbias = _SWIGLU_BACKWARD(grad_y, preact, need_dbias)
    return d_pre, dbias if need_dbias else None


def _check_packed(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    torch._check(weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
                 lambda: f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match: weight must be "
                         "[2 * n, in_features] with in_features the last dim of x")
    torch._check(weight.shape[0] % 2 == 0,
                 lambda: f"linear_swiglu: weight must be [2 * n, in_features], the gate rows stacked on the up "
                         f"rows, so its first dim must be even; got weight shape {tuple(weight.shape)}")
    torch._check(bias is None or tuple(bias.shape) == (weight.shape[0],),
                 lambda: f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")


@torch.library.register_fake("parallel_layers::linear_swiglu")
def _linear_swiglu_fake(x: Tensor, weight: Tensor, bias: Tensor | None, save_preact: bool) -> tuple[Tensor, Tensor]:
    _check_packed(x, weight, bias)
    n2 = weight.shape[0]
    return x.new_empty((*x.shape[:-1], n2 // 2)), x.new_empty((*x.shape[:-1], n2) if save_preact else (0,))


@torch.library.register_fake("parallel_layers::linear_swiglu_backward")
def _linear_swiglu_backward_fake(grad_y: Tensor, x: Tensor, weight: Tensor, preact: Tensor,
                                 output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    _check_packed(x, weight, None)
    n2 = weight.shape[0]
    out_shape, pre_shape = (*x.shape[:-1], n2 // 2), (*x.shape[:-1], n2)
    torch._check(tuple(grad_y.shape) == out_shape and tuple(preact.shape) == pre_shape,
                 lambda: f"linear_swiglu_backward: grad_y {tuple(grad_y.shape)} must have the output's shape "
                         f"{out_shape} and preact {tuple(preact.shape)} the pre-activation's shape {pre_shape}")
    need_dx, need_dw, need_db = output_mask
    return (x.new_empty(x.shape if need_dx else (0,)),
            x.new_empty(weight.shape if need_dw else (0,)),
            x.new_empty((n2,) if need_db else (0,)))


@torch.library.register_fake("parallel_layers::swiglu_backward")
def _swiglu_backward_fake(grad_y: Tensor, preact: Tensor, need_dbias: bool) -> tuple[Tensor, Tensor]:
    torch._check(preact.dim() >= 1 and preact.shape[-1] % 2 == 0 and grad_y.shape[:-1] == preact.shape[:-1]
                 and grad_y.shape[-1] * 2 == preact.shape[-1],
                 lambda: f"swiglu_backward: preact must be the packed pre-activation [..., 2n] (gate | up) and grad_y "
                         f"the output's gradient [..., n] with the same leading dims; got grad_y "
                         f"{tuple(grad_y.shape)} and preact {tuple(preact.shape)}")
    return preact.new_empty(preact.shape), preact.new_empty((preact.shape[-1],) if need_dbias else (0,))


# Autograd: a C++ kernel at the Autograd key (csrc/autograd.cpp, Note [autograd in C++]).
