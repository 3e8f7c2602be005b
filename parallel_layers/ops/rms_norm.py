"""Fused RMSNorm, as Hugging Face's LlamaRMSNorm (Qwen2, Qwen3, Mistral alike) computes it.

    y = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)    # the normalisation in float32

Shapes: x [..., n], weight [n] -> y [..., n]. Dtypes: float32, float64, bfloat16, float16; y has
the dtype `weight * h` has in the module: x's, or float32 for a 16-bit x with a float32 weight.
The normalisation runs in float32 (float64 for float64) and rounds to x's dtype before the
multiply by weight, as the module does; backward (`rms_norm_backward`, one pass over the data)
returns dx and this process's dweight, a plain sum over its rows (under sequence parallelism
the caller sums it over the tensor-parallel group). `rms_norm_add` first adds a residual and
returns the sum too, the next residual of a decoder. Kernels: csrc/rms_norm.cpp,
csrc/cuda/rms_norm.cpp (kernels in csrc/cuda/rms_norm_kernels.cu); the math, once, in
csrc/include/parallel_layers/rms_norm.h and rms_norm_math.h.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from parallel_layers.ops._call import op_call

_RMS_NORM = op_call("rms_norm")
_RMS_NORM_ADD = op_call("rms_norm_add")
_RMS_NORM_BACKWARD = op_call("rms_norm_backward")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`, the normalisation in float32."""
    y, _ = _RMS_NORM(x, weight, eps)
    return y


def rms_norm_add(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`(rms_norm(s, weight, eps), s)` with `s = x + residual` (rounded to their dtype), fused.

    x and residual [..., n] of one dtype. A decoder layer's `residual + hidden_states`
    followed by its next norm; s is the residual after that.
    """
    y, s, _ = _RMS_NORM_ADD(x, residual, weight, eps)
    return y, s


def rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                      grad_sum: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`(dx, dweight)` of `rms_norm` from the forward's x (for `rms_norm_add`: its sum) and rstd.

    grad_y like the forward's output; rstd [...] float32 (float64 for float64); grad_sum, the
    gradient of `rms_norm_add`'s sum, is added to dx. dweight sums this process's rows only, in
    float32 (float64), in an order fixed by the shape, and is rounded once to weight's dtype.
    Not differentiable.
    """
    return _RMS_NORM_BACKWARD(grad_y, x, weight, rstd, grad_sum)


class FusedRMSNorm(nn.Module):
    """A drop-in for LlamaRMSNorm (and Qwen2's, Qwen3's, Mistral's) that runs the fused op.

    Holds the module's names - `weight`, `variance_epsilon` - so state dicts, checkpoints and
    exports keep their keys. `forward(x)` is the norm; `forward(x, residual)` returns
    `rms_norm_add`'s `(normed, x + residual)`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_hf(cls, module: nn.Module) -> FusedRMSNorm:
        """A FusedRMSNorm sharing `module`'s weight Parameter (the same object: no copy, so a
        meta or memory-mapped weight stays one), for a Hugging Face RMSNorm of the Llama form."""
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
            raise TypeError(
                f"FusedRMSNorm.from_hf takes an RMSNorm of the Llama form, `weight * normed(x)` with a 1-D `weight` "
                f"Parameter and a float `variance_epsilon` (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm); "
                f"{type(module).__name__} has weight {_describe(weight)} and variance_epsilon {eps!r}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.weight = weight
        fused.variance_epsilon = eps
        return fused

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return rms_norm_add(hidden_states, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _describe(weight) -> str:
    return f"of shape {tuple(weight.shape)}" if isinstance(weight, Tensor) else repr(type(weight).__name__)


def _output_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The kernels' rule (csrc/include/parallel_layers/rms_norm.h, rms_kernel_weight)."""
    out = torch.promote_types(x.dtype, weight.dtype)
    x16 = x.dtype in (torch.float16, torch.bfloat16)
    torch._check(out == x.dtype or (x16 and out == torch.float32),
                 lambda: f"rms_norm: weight of dtype {weight.dtype} with x of dtype {x.dtype} would give a {out} "
                         "output; supported: a weight of x's dtype or narrower, or a float32 or 16-bit weight with "
                         "a 16-bit x")
    return out


def _check_shapes(x: Tensor, weight: Tensor) -> None:
    torch._check(x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"rms_norm: weight must have shape [{x.shape[-1] if x.dim() else '?'}] (the last dim of x "
                         f"{tuple(x.shape)}), got {tuple(weight.shape)}")


def _rstd_like(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


@torch.library.register_fake("parallel_layers::rms_norm")
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_shapes(x, weight)
    return x.new_empty(x.shape, dtype=_output_dtype(x, weight)), _rstd_like(x)


@torch.library.register_fake("parallel_layers::rms_norm_add")
def _rms_norm_add_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_shapes(x, weight)
    torch._check(residual.shape == x.shape and residual.dtype == x.dtype,
                 lambda: f"rms_norm_add: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return x.new_empty(x.shape, dtype=_output_dtype(x, weight)), x.new_empty(x.shape), _rstd_like(x)


@torch.library.register_fake("parallel_layers::rms_norm_backward")
def _rms_norm_backward_fake(grad_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                            grad_sum: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_shapes(x, weight)
    torch._check(grad_y.shape == x.shape and grad_y.dtype == _output_dtype(x, weight),
                 lambda: f"rms_norm_backward: grad_y {tuple(grad_y.shape)} {grad_y.dtype} must be like the forward "
                         f"output, {tuple(x.shape)} {_output_dtype(x, weight)}")
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# Autograd: a C++ kernel at the Autograd key (csrc/autograd.cpp, Note [autograd in C++]).
