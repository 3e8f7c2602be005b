"""`transpose_2d(x)`: `x.t().contiguous()` for a 2-D tensor, as one op.

On CPU, 16-bit tensors go through SSE2 8 x 8 register blocks (csrc/transpose.cpp), a few
times faster than ATen's element-wise transpose copy; `linear_weight_grad` uses it for the
row-major dz^T that ATen's bfloat16 CPU GEMM wants in dW = dz^T @ x (Note [weight-gradient
operand layout], csrc/linear_gelu.cpp). Other dtypes and CUDA use ATen's copy.
Differentiable (the gradient is the transposed gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallel_layers.ops._call import op_call

_TRANSPOSE_2D = op_call("transpose_2d")


def transpose_2d(x: Tensor) -> Tensor:
    """Return x^T as a new contiguous tensor; x must be 2-D."""
    return _TRANSPOSE_2D(x)


@torch.library.register_fake("parallel_layers::transpose_2d")
def _transpose_2d_fake(x: Tensor) -> Tensor:
    torch._check(x.dim() == 2, lambda: f"transpose_2d: x must be 2-D, got shape {list(x.shape)}")
    return x.new_empty((x.shape[1], x.shape[0]))


# Autograd: a C++ kernel at the Autograd key (csrc/autograd.cpp, Note [autograd in C++]).
