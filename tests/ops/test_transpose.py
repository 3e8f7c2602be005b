"""transpose_2d: exactly x.t().contiguous(), for every dtype and shape (SSE2 8 x 8 blocks and
their tails on CPU for 16-bit types); opcheck; autograd; bad input."""

import pytest
import torch

from parallel_layers.ops import transpose_2d
from tests.ops.numerics import devices

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# On and off the 8 x 8 blocks, the 64-column tasks and 64-row slabs; empty; one long row.
SHAPES = [(0, 5), (5, 0), (1, 1), (7, 13), (8, 8), (64, 64), (70, 130), (257, 1031), (1, 4096)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_transpose_copy(shape, dtype, device):
    x = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    out = transpose_2d(x)
    assert out.is_contiguous() and out.shape == (shape[1], shape[0])
    assert torch.equal(out, x.t())


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_input(device):
    x = torch.randn(40, 66, device=device).to(torch.bfloat16)[:, 1:65]  # row stride 66
    assert torch.equal(transpose_2d(x), x.t())
    y = torch.randn(66, 40, device=device).to(torch.bfloat16).t()  # already transposed view
    assert torch.equal(transpose_2d(y), y.t())


@pytest.mark.parametrize("device", devices())
def test_opcheck_and_gradient(device):
    for dtype in (torch.bfloat16, torch.float64):
        x = torch.randn(9, 17, dtype=dtype, device=device, requires_grad=True)
        torch.library.opcheck(torch.ops.parallel_layers.transpose_2d.default, (x,))
    x = torch.randn(9, 17, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(transpose_2d, (x,))
    # Inputs whose transpose is already contiguous: the output must still be new memory.
    for x in (torch.randn(1, 4, device=device), torch.randn(6, 5, device=device).t()):
        torch.library.opcheck(torch.ops.parallel_layers.transpose_2d.default, (x,))
        assert transpose_2d(x).data_ptr() != x.data_ptr()


def test_bad_input():
    with pytest.raises(RuntimeError, match=r"transpose_2d: x must be 2-D, got shape \[2, 3, 4\]"):
        transpose_2d(torch.randn(2, 3, 4))
