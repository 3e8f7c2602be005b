"""bias_gelu / bias_gelu_backward against a float64 reference, opcheck, gradcheck, torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import parallel_layers  # noqa: F401  (registers the ops)
from parallel_layers.ops import bias_gelu, bias_gelu_backward
from tests.ops.numerics import assert_within_rounding, devices, max_abs_error

APPROX = ["none", "tanh"]
# (shape of x); bias is [x.shape[-1]]. Degenerate sizes, odd sizes, 3-D, one large enough
# that the CPU kernels split rows over several threads and chunks, and 70 x 64: whole 16-byte
# units for every dtype on CUDA, with three chunks (32, 32, 6 rows) in the bias sum.
SHAPES = [(0, 5), (5, 0), (1, 1), (7, 13), (3, 4, 33), (1, 300), (300, 1), (257, 1031), (70, 64)]
FLOAT_DTYPES = [torch.float32, torch.float64]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    # Spread of 3 puts values in the tails of GeLU, where its cancellations are.
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


def _reference(x, b, approximate):
    z = x.double() + b.double()
    return F.gelu(z, approximate=approximate), z


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64(shape, approximate, dtype, device):
    x, b = _inputs(shape, dtype, device)
    y, z = torch.ops.parallel_layers.bias_gelu(x, b, approximate)
    y_ref, z_ref = _reference(x, b, approximate)
    # z is one rounded addition (<= 0.5 ulp); y adds erf/tanh (~1-2 ulp each) and the
    # cancellation of 1 + erf for negative z, which the |z| scale term covers.
    assert_within_rounding(z, z_ref, torch.zeros_like(z_ref), ulps=0.5, what="pre-activation")
    assert_within_rounding(y, y_ref, z_ref, ulps=4, what="gelu")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_float64(shape, approximate, dtype, device):
    x, b = _inputs(shape, dtype, device, requires_grad=True)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device, dtype)
    bias_gelu(x, b, approximate).backward(dy)

    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    F.gelu(x64 + b64, approximate=approximate).backward(dy.double())
    z = (x64 + b64).detach()
    # dx = dy * gelu'(z): a few roundings of the terms of gelu', which cancel for negative z;
    # the largest term is O(|z|) (exact form) or O(|z|^3) (tanh form: z * s(1-s) * d(2u)/dz).
    scale = dy.double().abs() * (1 + z.abs()) ** 3
    assert_within_rounding(x.grad, x64.grad, scale, ulps=4, what="grad x")
    # dbias sums rows of dx in float32/float64: rounding grows with the number of rows and
    # is relative to the sum of the rows' error scales, not to the (possibly cancelling) sum.
    n = shape[-1]
    rows = x.numel() // n if n else 0
    row_scale = scale.reshape(rows, n).sum(0) if n else torch.zeros(0, dtype=torch.float64)
    assert_within_rounding(b.grad, b64.grad, row_scale.to(device), ulps=4 + rows ** 0.5, what="grad bias")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("approximate", APPROX)
# 517 x 264 on CUDA: 16-byte units (8 elements) in the forward and the backward, whose bias sum
# runs 17 chunks of row lanes (parallel_layers/cuda/column_sums.h), the last of 5 rows.
@pytest.mark.parametrize("shape", [(129, 257), (517, 264)])
def test_16bit_no_worse_than_eager(shape, dtype, approximate, device):
    x, b = _inputs(shape, dtype, device, requires_grad=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y = bias_gelu(x, b, approximate)
    y.backward(dy)
    ours = (y.detach(), x.grad.clone(), b.grad.clone())
    x.grad = b.grad = None
    y_eager = F.gelu(x + b, approximate=approximate)
    y_eager.backward(dy)
    eager = (y_eager.detach(), x.grad, b.grad)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y64 = F.gelu(x64 + b64, approximate=approximate)
    y64.backward(dy.double())
    for name, o, e, r in zip(("y", "grad x", "grad bias"), ours, eager, (y64, x64.grad, b64.grad)):
        # Our math runs in float32 and rounds once at the end, so it should never be worse
        # than eager's 16-bit chain; 2x leaves room for ties in a different rounding spot.
        assert max_abs_error(o, r) <= 2 * max_abs_error(e, r), name


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_input(device):
    base = torch.randn(33, 20, dtype=torch.float64, device=device)
    x = base.t()  # [20, 33], strides (1, 20)
    b = torch.randn(33, dtype=torch.float64, device=device)
    y, z = torch.ops.parallel_layers.bias_gelu(x, b, "none")
    torch.testing.assert_close(y, F.gelu(x + b), rtol=0, atol=1e-14)
    assert y.is_contiguous() and z.is_contiguous()


@pytest.mark.parametrize("device", devices())
def test_autocast_promotes_like_eager_add(device):
    """Under autocast a 16-bit activation and a float32 bias compute in float32, as
    F.gelu(x + bias) does in eager (outside autocast the mixed dtypes are an error); the
    gradients come back in each input's own dtype."""
    low = torch.bfloat16 if device == "cpu" else torch.float16
    x, b = _inputs((6, 40), torch.float32, device)
    x = x.to(low)

    def run(fn):
        xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.autocast(device, dtype=low):
            y = fn(xg, bg)
        y.sum().backward()
        return y.detach(), xg.grad, bg.grad

    ours = run(lambda x, b: bias_gelu(x, b, "tanh"))
    eager = run(lambda x, b: F.gelu(x + b, approximate="tanh"))
    assert [t.dtype for t in ours] == [t.dtype for t in eager] == [torch.float32, low, torch.float32]
    for o, e in zip(ours, eager):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        bias_gelu(x, b, "tanh")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("approximate", APPROX)
def test_gradcheck(approximate, device):
    x, b = _inputs((6, 7), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: bias_gelu(x, b, approximate), (x, b))


@pytest.mark.parametrize("device", devices())
def test_gradient_through_preactivation_output(device):
    # Both outputs used downstream: dz must add to the gelu path.
    x, b = _inputs((5, 4), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, b: sum(t.sin().sum() for t in torch.ops.parallel_layers.bias_gelu(x, b, "tanh")), (x, b))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 3), (4, 9), (2, 3, 5), (1, 5), (4, 1)])
def test_opcheck(shape, dtype, device):
    x, b = _inputs(shape, dtype, device, requires_grad=dtype == torch.float32)
    for approximate in APPROX:
        torch.library.opcheck(torch.ops.parallel_layers.bias_gelu.default, (x, b, approximate))
        dy = torch.randn(shape, dtype=dtype, device=device)
        z = (x + b).detach()
        torch.library.opcheck(torch.ops.parallel_layers.bias_gelu_backward.default, (dy, z, approximate))


# Note [no subnormals in the GeLU math] (csrc/include/parallel_layers/gelu.h): from normal
# inputs the kernels produce normal numbers or exact zeros, never subnormals (x86 runs every
# SIMD instruction that touches one ~100x slower). The inputs reach far into both tails.
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", APPROX)
def test_no_subnormal_results(approximate, dtype, device):
    mags = torch.logspace(-3, 4, 400, dtype=torch.float64)
    z = torch.cat([mags, -mags]).to(device=device, dtype=dtype).reshape(8, 100)
    y, _ = torch.ops.parallel_layers.bias_gelu(z, torch.zeros(100, dtype=dtype, device=device), approximate)
    dz, _ = torch.ops.parallel_layers.bias_gelu_backward(torch.ones_like(z), z, approximate)
    tiny = torch.finfo(dtype).tiny
    for name, r in (("gelu", y), ("gelu'", dz)):
        sub = (r != 0) & (r.abs() < tiny)
        assert not sub.any(), f"{name} is subnormal at z = {z[sub][:5].tolist()}: {r[sub][:5].tolist()}"
    # ... and still GeLU: within rounding of float64 (tails included; see test_forward_matches_float64).
    ref = F.gelu(z.double(), approximate=approximate)
    assert_within_rounding(y, ref, z, ulps=8, what=f"gelu {approximate} {dtype} over 7 decades")


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    def f(x, b):
        return bias_gelu(x * 2, b, "tanh").sum()

    x, b = _inputs((8, 16), torch.float32, device, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, b)
    out.backward()
    gx, gb = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    f(x, b).backward()
    torch.testing.assert_close(out, f(x, b))
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gb, b.grad)


def test_torch_compile_inductor_cpu():
    x, b = _inputs((8, 16), torch.float32, "cpu")
    compiled = torch.compile(lambda x, b: bias_gelu(x, b, "none") + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x, b), F.gelu(x + b) + 1)


@pytest.mark.parametrize("device", devices())
# 4099 x 257 is more elements than the forward's grid has threads (at most 8 blocks of 256 per
# SM), so its grid-stride loop wraps and RowColCursor carries columns into rows.
# 517 x 264: rows of whole 16-byte units, the vectorized path (parallel_layers/cuda/vec.h), in
# fewer units than one wave; 16384 x 264 in bfloat16: 8 elements a unit, 540,672 units, more than
# one resident wave of the largest GPUs (132 SMs x 2048 threads = 270,336), so the vectorized
# loop wraps and RowColCursor advances in units.
@pytest.mark.parametrize("shape, dtype", [((300, 129), torch.float32), ((4099, 257), torch.float32),
                                          ((517, 264), torch.float32), ((16384, 264), torch.bfloat16)])
def test_cuda_matches_cpu(device, shape, dtype):
    if device == "cpu":
        pytest.skip("compares the CUDA kernels with the CPU ones")
    x, b = _inputs(shape, dtype, "cpu")
    dy = torch.randn(x.shape).to(dtype)
    # float32: erff/tanhf differ by ~1 ulp; 16-bit: both round the same float32 value once, so
    # they differ by at most one ulp of the 16-bit result where the float32 values straddle a tie
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    tol_b = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else tol
    for approximate in APPROX:
        cpu = torch.ops.parallel_layers.bias_gelu(x, b, approximate)
        gpu = torch.ops.parallel_layers.bias_gelu(x.cuda(), b.cuda(), approximate)
        for c, g in zip(cpu, gpu):
            torch.testing.assert_close(g.cpu(), c, **tol)
        cpu_b = torch.ops.parallel_layers.bias_gelu_backward(dy, cpu[1], approximate)
        gpu_b = torch.ops.parallel_layers.bias_gelu_backward(dy.cuda(), cpu[1].cuda(), approximate)
        torch.testing.assert_close(gpu_b[0].cpu(), cpu_b[0], **tol_b)
        # dbias: each op sums its own rounded dz, in its own order (4099 rows: the order matters
        # more than 1e-5), so each is held to its float64 sum: within 8 float32 ulps of sum |dz|
        # (and half an ulp of the result's dtype, where it is 16-bit).
        for dz, db in (cpu_b, gpu_b):
            dz, db = dz.cpu().double(), db.cpu().double()
            exact = dz.sum(0)
            bound = 8 * torch.finfo(torch.float32).eps * dz.abs().sum(0) + torch.finfo(dtype).eps * exact.abs()
            assert ((db - exact).abs() <= bound).all(), (db - exact).abs().max()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(3, 4), torch.randn(4), "exact"), "approximate must be 'none' or 'tanh', got 'exact'"),
        (lambda: (torch.randn(3, 4), torch.randn(5), "none"),
         r"bias has 5 elements but the last dim of x is 4 \(x shape \[3, 4\]\)"),
        (lambda: (torch.randn(3, 4), torch.randn(4, dtype=torch.float64), "none"),
         "x has dtype Float but bias has dtype Double"),
        (lambda: (torch.randn(3, 4), torch.randn(1, 4), "none"), r"bias must be 1-D, got shape \[1, 4\]"),
        (lambda: (torch.ones(3, 4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), "none"),
         "x must be float32, float64, float16 or bfloat16, got Int"),
        (lambda: (torch.tensor(1.0), torch.randn(1), "none"), r"x must have at least 1 dimension, got shape \[\]"),
    ],
)
def test_bad_input_messages(make, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.parallel_layers.bias_gelu(*make())


def test_backward_bad_input_messages():
    with pytest.raises(RuntimeError, match=r"grad_out has shape \[3, 4\] but preact has shape \[3, 5\]"):
        bias_gelu_backward(torch.randn(3, 4), torch.randn(3, 5), "none")
