"""Every branch of the autograd kernels (csrc/autograd.cpp, Note [autograd in C++]) against
float64 finite differences: each output used alone and together (an unused output's gradient
arrives undefined), the pre-activation recomputed when it was not kept, no bias, a 1-D input."""

import pytest
import torch

import parallel_layers.ops  # noqa: F401  (loads the ops and their fake kernels)

P = torch.ops.parallel_layers


def _weighted_sum(outputs):
    """A loss that uses every output, each with its own weight (so no two share a gradient)."""
    return sum(t.sum() * (i + 2) for i, t in enumerate(outputs))


CASES = {
    "linear_gelu, y and preact": (lambda x, w, b: _weighted_sum(P.linear_gelu(x, w, b, "tanh", True)), "x w b"),
    "linear_gelu, preact not kept": (lambda x, w, b: P.linear_gelu(x, w, b, "none", False)[0], "x w b"),
    "linear_gelu, preact alone": (lambda x, w, b: P.linear_gelu(x, w, b, "tanh", True)[1], "x w b"),
    "linear_gelu, no bias": (lambda x, w: P.linear_gelu(x, w, None, "tanh", True)[0], "x w"),
    "linear_swiglu, y and preact": (lambda x, w2, b2: _weighted_sum(P.linear_swiglu(x, w2, b2, True)), "x w2 b2"),
    "linear_swiglu, preact not kept, no bias": (lambda x, w2: P.linear_swiglu(x, w2, None, False)[0], "x w2"),
    "bias_gelu, y and z": (lambda x, c: _weighted_sum(P.bias_gelu(x, c, "tanh")), "x c"),
    "bias_gelu, z alone": (lambda x, c: P.bias_gelu(x, c, "none")[1], "x c"),
    "bias_gelu, 1-D, y and z": (lambda v, c: _weighted_sum(P.bias_gelu(v, c, "tanh")), "v c"),
    "rms_norm": (lambda x, g: P.rms_norm(x, g, 1e-6)[0], "x g"),
    "rms_norm_add, y and sum": (lambda x, r, g: _weighted_sum(P.rms_norm_add(x, r, g, 1e-6)[:2]), "x r g"),
    "rms_norm_add, sum alone": (lambda x, r, g: P.rms_norm_add(x, r, g, 1e-6)[1], "x r g"),
    "transpose_2d": (lambda x: P.transpose_2d(x), "x"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_autograd_kernel_branches_match_finite_differences(case):
    g = torch.Generator().manual_seed(0)
    shapes = {"x": (3, 5), "w": (4, 5), "b": (4,), "w2": (8, 5), "b2": (8,), "c": (5,), "v": (5,), "r": (3, 5),
              "g": (5,)}
    fn, names = CASES[case]
    inputs = tuple(torch.randn(*shapes[n], generator=g, dtype=torch.float64).requires_grad_() for n in names.split())
    assert torch.autograd.gradcheck(fn, inputs)


def test_only_the_inputs_that_need_it_get_a_gradient():
    """needs_input_grad: a frozen weight or bias gets none, and the op's backward is not asked for it."""
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, dtype=torch.float64, requires_grad=True)
    y, _ = P.linear_gelu(x, w, b, "tanh", True)
    dx, db = torch.autograd.grad(y.sum(), (x, b))
    assert dx.shape == x.shape and db.shape == b.shape
    y, _ = P.linear_gelu(x, w, b, "tanh", True)
    y.sum().backward()
    assert w.grad is None and x.grad is not None
