"""linear_gelu against a float64 reference (forward and backward), 16-bit against eager,
opcheck, gradcheck, torch.compile, and the inference path that keeps no pre-activation."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import parallel_layers
from parallel_layers.ops import (bias_gelu_backward, linear_autocast_inputs, linear_forward, linear_gelu,
                                 linear_input_grad,
                                 linear_weight_grad, transpose_2d)
from tests.ops.numerics import (BF16_GEMMS_WIDEN, FP32_GEMMS_ONEDNN, conversions_inside, cpu_gemm, device_gemms,
                                devices, fp32_linear, max_abs_error)

APPROX = ["none", "tanh"]
# (x shape, out_features): degenerate M, N, K, odd sizes, 3-D, one big enough for several
# CPU panels and epilogue tasks.
CASES = [((0, 8), 5), ((1, 8), 5), ((7, 1), 9), ((6, 13), 1), ((3, 4, 33), 17), ((257, 64), 40),
         ((1100, 96), 2000)]


def _inputs(x_shape, n, dtype, device, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / max(k, 1) ** 0.5 * 2
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


def _rel_error(actual, reference):
    """max |actual - reference| / max |reference| (0 for empty tensors)."""
    if reference.numel() == 0:
        return 0.0
    return max_abs_error(actual, reference) / max(reference.abs().max().item(), 1e-30)


def _reference(x, w, b, approximate):
    x64, w64 = x.double(), w.double()
    b64 = None if b is None else b.double()
    pre = F.linear(x64, w64, b64)
    return F.gelu(pre, approximate=approximate), pre


# float32: relative error (max-norm) under 1e-5, the acceptance bound. The GEMM's own
# rounding is ~sqrt(K) * eps ~ 1e-6 for these K.
F32_RTOL = 1e-5


@pytest.mark.parametrize("device, gemm", device_gemms())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("x_shape, n", CASES)
def test_forward_float32_matches_float64(x_shape, n, approximate, bias, device, gemm):
    with cpu_gemm(gemm):
        _check_forward_float32(x_shape, n, approximate, bias, device)


def _check_forward_float32(x_shape, n, approximate, bias, device):
    x, w, b = _inputs(x_shape, n, torch.float32, device, bias)
    y, pre = torch.ops.parallel_layers.linear_gelu(x, w, b, approximate, True)
    y_ref, pre_ref = _reference(x, w, b, approximate)
    assert y.shape == y_ref.shape and pre.shape == pre_ref.shape
    assert _rel_error(y, y_ref) < F32_RTOL
    assert _rel_error(pre, pre_ref) < F32_RTOL
    # Without save_preact the pre-activation is not materialised and y is the same: bit for bit
    # on CPU (one code path); on CUDA cuBLASLt picks a kernel per epilogue (GELU_BIAS vs
    # GELU_AUX_BIAS), which may sum in another order.
    y2, none = torch.ops.parallel_layers.linear_gelu(x, w, b, approximate, False)
    assert none.numel() == 0
    if device == "cpu":
        torch.testing.assert_close(y2, y, rtol=0, atol=0)
    else:
        assert _rel_error(y2, y_ref) < F32_RTOL


@pytest.mark.parametrize("device, gemm", device_gemms())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("x_shape, n", CASES)
def test_backward_float32_matches_float64(x_shape, n, approximate, bias, device, gemm):
    x, w, b = _inputs(x_shape, n, torch.float32, device, bias)
    params = [t.requires_grad_() for t in (x, w, b) if t is not None]
    dy = torch.randn(*x_shape[:-1], n, generator=torch.Generator().manual_seed(1)).to(device)
    with cpu_gemm(gemm):
        linear_gelu(x, w, b, approximate).backward(dy)
    ref_params = [t.detach().double().requires_grad_() for t in params]
    xr, wr = ref_params[0], ref_params[1]
    br = ref_params[2] if bias else None
    F.gelu(F.linear(xr, wr, br), approximate=approximate).backward(dy.double())
    for name, p, r in zip(("x", "weight", "bias"), params, ref_params):
        assert _rel_error(p.grad, r.grad) < F32_RTOL, name


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (False, True, True)])
def test_only_needed_gradients(needs, device):
    x, w, b = _inputs((5, 6), 7, torch.float64, device)
    for t, need in zip((x, w, b), needs):
        t.requires_grad_(need)
    linear_gelu(x, w, b).sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_(need) for t, need in zip((x, w, b), needs))
    F.gelu(F.linear(xr, wr, br), approximate="tanh").sum().backward()
    for t, r, need in zip((x, w, b), (xr, wr, br), needs):
        if need:
            torch.testing.assert_close(t.grad, r.grad, rtol=1e-12, atol=1e-12)
        else:
            assert t.grad is None


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("bias", [True, False])
def test_16bit_no_worse_than_twice_eager(dtype, approximate, bias, device):
    x, w, b = _inputs((96, 80), 48, dtype, device, bias)
    leaves = [t for t in (x, w, b) if t is not None]
    dy = torch.randn(96, 48, generator=torch.Generator().manual_seed(2)).to(device, dtype)

    def run(fn, ts):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        out = fn(*ts)
        out.backward(dy.to(out.dtype))
        return [out.detach()] + [t.grad for t in ts]

    with_bias = lambda f: (lambda x, w, b=None: f(x, w, b))  # noqa: E731
    ours = run(with_bias(lambda x, w, b: linear_gelu(x, w, b, approximate)), leaves)
    eager = run(with_bias(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate)), leaves)
    ref = run(with_bias(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate)),
              [t.double() for t in leaves])
    for name, o, e, r in zip(("y", "grad x", "grad weight", "grad bias"), ours, eager, ref):
        assert max_abs_error(o, r) <= 2 * max_abs_error(e, r), name


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_and_3d_input(device):
    x, w, b = _inputs((4, 6, 10), 12, torch.float32, device)
    xt = x.transpose(0, 1)  # [6, 4, 10], not contiguous
    y = linear_gelu(xt, w, b, "none")
    torch.testing.assert_close(y, F.gelu(F.linear(xt, w, b)), rtol=1e-5, atol=1e-6)  # float32 GEMM rounding


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("approximate", APPROX)
def test_gradcheck(approximate, device):
    x, w, b = _inputs((4, 5), 3, torch.float64, device)
    assert torch.autograd.gradcheck(lambda x, w, b: linear_gelu(x, w, b, approximate),
                                    (x.requires_grad_(), w.requires_grad_(), b.requires_grad_()))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("x_shape, n", [((4, 5), 3), ((4, 0), 3)])  # K = 0: the pre-activation is the bias
def test_recomputes_preact_if_called_without_it_under_autograd(x_shape, n, device):
    x, w, b = _inputs(x_shape, n, torch.float64, device)
    x.requires_grad_()
    b.requires_grad_()
    y, pre = torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", False)
    assert pre.numel() == 0
    y.sum().backward()
    xr, br = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    F.gelu(F.linear(xr, w, br), approximate="tanh").sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(b.grad, br.grad)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, out))
        return out


def test_inference_does_not_materialise_preact():
    x, w, b = _inputs((8, 16), 32, torch.float32, "cpu")
    w.requires_grad_()
    for grad_enabled, expect_saved in ((False, False), (True, True)):
        with torch.set_grad_enabled(grad_enabled), _RecordOps() as rec:
            linear_gelu(x, w, b)
        (call,) = [c for c in rec.calls if c[0] == torch.ops.parallel_layers.linear_gelu.default]
        _, args, (_, pre) = call
        assert args[4] is expect_saved
        assert pre.numel() == (8 * 32 if expect_saved else 0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape, n", [((0, 4), 3), ((5, 4), 3), ((2, 3, 8), 16)])
def test_opcheck(x_shape, n, dtype, device):
    for bias in (True, False):
        x, w, b = _inputs(x_shape, n, dtype, device, bias)
        x.requires_grad_(dtype == torch.float32)
        w.requires_grad_(dtype == torch.float32)
        for approximate in APPROX:
            for save in (True, False):
                torch.library.opcheck(torch.ops.parallel_layers.linear_gelu.default, (x, w, b, approximate, save))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape, n", [((0, 4), 3), ((5, 4), 3), ((2, 3, 8), 16), ((70, 9), 33)])
def test_backward_op_opcheck(x_shape, n, dtype, device):
    x, w, _ = _inputs(x_shape, n, dtype, device)
    g = torch.Generator().manual_seed(3)
    dy, z = (torch.randn(*x_shape[:-1], n, generator=g).to(device, dtype) for _ in range(2))
    for approximate in APPROX:
        for mask in ([True, True, True], [False, True, False], [True, False, True], [False, False, False]):
            torch.library.opcheck(torch.ops.parallel_layers.linear_gelu_backward.default,
                                  (dy, x, w, z, approximate, mask))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_op_mask_selects_without_changing_values(dtype, device):
    """Each gradient is the same bits whichever others are asked for (16-bit CPU dweight comes
    from the transposed dz, written with or without the plain dz), and unasked ones are empty.
    70 rows: two full 32-row tiles of the transposed write and a partial one."""
    x, w, _ = _inputs((70, 24), 40, dtype, device)
    g = torch.Generator().manual_seed(4)
    dy, z = (torch.randn(70, 40, generator=g).to(device, dtype) for _ in range(2))
    op = torch.ops.parallel_layers.linear_gelu_backward
    full = op(dy, x, w, z, "tanh", [True, True, True])
    ref_dz = dy.double() * torch.ops.aten.gelu_backward(torch.ones_like(z, dtype=torch.float64), z.double(),
                                                        approximate="tanh")
    torch.testing.assert_close(full[1].double(), ref_dz.t() @ x.double(), rtol=0.05, atol=0.05)
    for mask in ([True, False, False], [False, True, False], [False, False, True], [False, True, True]):
        got = op(dy, x, w, z, "tanh", mask)
        for need, value, expected in zip(mask, got, full):
            if need:
                assert torch.equal(value, expected)
            else:
                assert value.numel() == 0


# The split backward (bias_gelu_backward, then linear_weight_grad), which callers with an
# autograd Function of their own use (the tensor-parallel column layer), and the fused op give
# the same bits: one layout rule for the weight-gradient GEMM (Note [weight-gradient operand
# layout], csrc/linear_gelu.cpp), however dz^T is produced. Rows and columns on and off the
# CPU pass's 32-row tiles and 8 x 8 transpose blocks; 3-D; empty.
SPLIT_CASES = [((0, 4), 5), ((1, 3), 1), ((70, 13), 24), ((3, 11, 40), 17), ((257, 31), 1031)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape, n", SPLIT_CASES)
def test_split_backward_matches_the_fused_op_bitwise(x_shape, n, dtype, device):
    x, w, _ = _inputs(x_shape, n, dtype, device)
    g = torch.Generator().manual_seed(5)
    dy, z = (torch.randn(*x_shape[:-1], n, generator=g).to(device, dtype) for _ in range(2))
    op = torch.ops.parallel_layers.linear_gelu_backward
    dz, db = bias_gelu_backward(dy, z, "tanh")
    dz2, x2 = dz.reshape(-1, n), x.reshape(-1, x_shape[-1])
    for gemm in ("aten", "onednn"):  # either float32 CPU GEMM rule (Note [float32 GEMMs through oneDNN])
        with cpu_gemm(gemm):
            split = (linear_input_grad(dz2, w).view(x.shape), linear_weight_grad(dz2, x2), db)
            for mask in ([True, True, True], [False, True, False]):  # dweight alone: the CPU pass writes dz^T only
                for need, fused, mine in zip(mask, op(dy, x, w, z, "tanh", mask), split):
                    if need:
                        assert torch.equal(fused, mine)


def _cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX-BF16, as /proc/cpuinfo names them (False where there is no such file)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.parametrize("dtype, row_major", [(torch.bfloat16, _cpu_has_native_bf16()), (torch.float16, False),
                                              (torch.float32, False), (torch.float64, False)])
def test_weight_grad_layout_rule_on_cpu(dtype, row_major):
    """Note [weight-gradient operand layout]: on CPU only bfloat16 hands the GEMM a row-major dz^T,
    and only where the CPU has bfloat16 dot products (on an AVX2-only CPU that layout ran ~11x
    slower); the others read the transposed view, as eager autograd does."""
    x, w, _ = _inputs((70, 24), 40, dtype, "cpu")
    dz = torch.randn(70, 40, generator=torch.Generator().manual_seed(6)).to(dtype)
    expected = transpose_2d(dz) @ x if row_major else dz.t() @ x
    assert torch.equal(linear_weight_grad(dz, x), expected)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_weight_grad_no_worse_than_twice_eager(dtype, device):
    x, w, _ = _inputs((3, 50, 24), 40, dtype, device)
    dz = torch.randn(3, 50, 40, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    ref = dz.double().reshape(-1, 40).t() @ x.double().reshape(-1, 24)
    eager = dz.reshape(-1, 40).t() @ x.reshape(-1, 24)
    ours = linear_weight_grad(dz, x)
    assert ours.shape == (40, 24) and ours.dtype == dtype
    assert max_abs_error(ours, ref) <= 2 * max_abs_error(eager, ref) + 1e-12  # + 0 when both are exact


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# (1, 5) and (4, 1): dz transposed is a contiguous view of dz, and the bfloat16 copy must still copy.
@pytest.mark.parametrize("dz_shape, k", [((0, 4), 3), ((1, 5), 3), ((4, 1), 3), ((2, 3, 8), 16), ((70, 9), 33)])
def test_linear_weight_grad_opcheck(dz_shape, k, dtype, device):
    g = torch.Generator().manual_seed(8)
    dz = torch.randn(dz_shape, generator=g).to(device, dtype)
    x = torch.randn(*dz_shape[:-1], k, generator=g).to(device, dtype)
    torch.library.opcheck(torch.ops.parallel_layers.linear_weight_grad.default, (dz, x))


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda: (torch.randn(3, 4), torch.randn(2, 5)),
         r"linear_weight_grad: grad_out \[3, 4\] and x \[2, 5\] must have the same leading dims"),
        (lambda: (torch.randn(3, 4), torch.randn(3, 5, dtype=torch.float64)), "x has dtype Double but grad_out has dtype Float"),
        (lambda: (torch.randn(3, 4), torch.tensor(1.0)),
         r"linear_weight_grad: grad_out and x must have at least 1 dimension, got shapes \[3, 4\] and \[\]"),
    ],
)
def test_linear_weight_grad_bad_input_messages(args, message):
    with pytest.raises(RuntimeError, match=message):
        linear_weight_grad(*args())


def test_backward_scratch_reuse_leaves_earlier_results_alone():
    """The CPU backward reuses its dz / dz^T scratch across calls (Note [backward scratch on
    CPU], csrc/linear_gelu.cpp): results of one call stay intact after later calls of other
    shapes and dtypes, and every call's gradients are what a fresh process computes."""
    op = torch.ops.parallel_layers.linear_gelu_backward
    calls = [((96, 24), 40, torch.bfloat16), ((50, 16), 24, torch.float32), ((200, 32), 64, torch.bfloat16),
             ((7, 8), 5, torch.float16), ((96, 24), 40, torch.bfloat16)]
    results = []
    for seed, (x_shape, n, dtype) in enumerate(calls):
        x, w, _ = _inputs(x_shape, n, dtype, "cpu", seed=seed)
        g = torch.Generator().manual_seed(10 + seed)
        dy, z = (torch.randn(x_shape[0], n, generator=g).to(dtype) for _ in range(2))
        out = op(dy, x, w, z, "tanh", [True, True, True])
        results.append((out, [t.clone() for t in out], (dy, x, w, z)))
    for out, snapshot, _ in results:  # nothing returned aliases the reused scratch
        for a, b in zip(out, snapshot):
            assert torch.equal(a, b)
    for _, snapshot, (dy, x, w, z) in results:  # a rerun after all of them gives the same bits
        for a, b in zip(snapshot, op(dy, x, w, z, "tanh", [True, True, True])):
            assert torch.equal(a, b)


def test_backward_scratch_threads_and_requests_over_its_cap():
    """Two threads running the CPU backward at once each get their own scratch, and a request
    over the per-buffer cap (64 MiB: float32 [2900, 5800] is 67 MB) takes a plain allocation;
    both give the same gradients as aten's gelu_backward followed by the GEMMs."""
    import threading

    op = torch.ops.parallel_layers.linear_gelu_backward

    def case(rows, n, k, seed):
        x, w, _ = _inputs((rows, k), n, torch.float32, "cpu", seed=seed)
        g = torch.Generator().manual_seed(seed)
        dy, z = (torch.randn(rows, n, generator=g) for _ in range(2))
        dz = torch.ops.aten.gelu_backward(dy, z, approximate="tanh")
        return (dy, x, w, z), (dz @ w, dz.t() @ x, dz.sum(0))

    def check(args, want):
        for got, expected in zip(op(*args, "tanh", [True, True, True]), want):
            assert got.shape == expected.shape and _rel_error(got, expected) < F32_RTOL

    big_args, big_want = case(2900, 5800, 4, seed=1)
    check(big_args, big_want)
    cases = [case(300 + 50 * i, 256, 32, seed=2 + i) for i in range(2)]
    errors = []

    def worker(args, want):
        try:
            for _ in range(20):
                check(args, want)
        except Exception as e:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    def mlp(x, w1, b1, w2):
        return F.linear(linear_gelu(x, w1, b1), w2).square().mean()

    x, w1, b1 = _inputs((8, 16), 32, torch.float32, device)
    w2 = torch.randn(4, 32, device=device)
    leaves = [t.requires_grad_() for t in (x, w1, b1, w2)]
    compiled = torch.compile(mlp, fullgraph=True)
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves)
    out_ref = mlp(*leaves)
    grads_ref = torch.autograd.grad(out_ref, leaves)
    torch.testing.assert_close(out, out_ref)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_runs_in_the_autocast_dtype_like_linear(compiled, device):
    """Under torch.autocast the op computes in the autocast dtype, as F.linear does, from
    float32 inputs; the gradients (backward after the region closes) are float32, and all
    of it is as close to float64 as eager autocast's F.gelu(F.linear(...))."""
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    x, w, b = _inputs((64, 48), 40, torch.float32, device)
    dy = torch.randn(64, 40, generator=torch.Generator().manual_seed(2)).to(device)
    ours_fn = torch.compile(linear_gelu, fullgraph=True) if compiled else linear_gelu

    def run(fn, dtype, use_autocast):
        ts = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        with torch.autocast(device, dtype=autocast_dtype, enabled=use_autocast):
            out = fn(*ts)
        (out.double() * dy.double()).sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    ours = run(lambda x, w, b: ours_fn(x, w, b, "tanh"), torch.float32, True)
    eager = run(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), torch.float32, True)
    ref = run(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), torch.float64, False)
    assert [t.dtype for t in ours] == [autocast_dtype] + [torch.float32] * 3
    assert [t.dtype for t in eager] == [t.dtype for t in ours]
    for name, o, e, r in zip(("y", "grad x", "grad weight", "grad bias"), ours, eager, ref):
        assert max_abs_error(o, r) <= 2 * max_abs_error(e, r), name


@pytest.mark.parametrize("device", devices())
def test_linear_autocast_inputs_are_the_casts_linear_gelu_makes(device):
    """linear_autocast_inputs hands out the op's own autocast policy: inside the region, what
    linear_gelu computes with (same bits, the same cached weight cast), float64 left alone;
    differentiable casts, so float32 leaves get float32 gradients; outside, the tensors themselves."""
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    x, w, b = _inputs((6, 8), 5, torch.float32, device)
    w.requires_grad_()
    assert all(o is i for o, i in zip(linear_autocast_inputs(x, w, b), (x, w, b)))
    assert linear_autocast_inputs(x, w)[2] is None
    with torch.autocast(device, dtype=autocast_dtype):
        xc, wc, bc = linear_autocast_inputs(x, w, b)
        assert [t.dtype for t in (xc, wc, bc)] == [autocast_dtype] * 3
        assert linear_autocast_inputs(x, w, b)[1].data_ptr() == wc.data_ptr()  # autocast's cache
        y = linear_gelu(x, w, b)
        x64, w64, _ = _inputs((6, 8), 5, torch.float64, device)
        assert all(t.dtype == torch.float64 for t in linear_autocast_inputs(x64, w64)[:2])
    assert torch.equal(y, linear_gelu(xc, wc, bc))
    linear_gelu(xc, wc, bc).sum().backward()  # outside the region
    assert w.grad.dtype == torch.float32


def test_linear_autocast_inputs_under_torch_compile():
    def f(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(*linear_autocast_inputs(x, w, b))

    x, w, b = _inputs((6, 8), 5, torch.float32, "cpu")
    out = torch.compile(f, fullgraph=True)(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, f(x, w, b))


def _offset_view(t, offset):
    """t's values in a view that starts `offset` elements into a larger buffer (so its address
    is aligned only to offset * itemsize bytes, as a slice of a bigger tensor is)."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


@contextlib.contextmanager
def cuda_gelu_path(path):
    """linear_gelu's CUDA forward path (Note [linear_gelu's CUDA forward path]) for a block."""
    from parallel_layers import _C
    previous = _C._set_cuda_gelu_path(path)
    try:
        yield
    finally:
        _C._set_cuda_gelu_path(previous)


def test_cuda_gelu_path_setting_names_the_valid_values():
    from parallel_layers import _C
    if not hasattr(_C, "_set_cuda_gelu_path"):
        pytest.skip("this build has no CUDA kernels (the setting exists where they are compiled)")
    with pytest.raises(RuntimeError, match=r"the CUDA GeLU path must be 'kernel' \(ATen's GEMM, then our GeLU "
                                           r"kernel\) or 'cublaslt' .*; got 'lt'"):
        _C._set_cuda_gelu_path("lt")
    with cuda_gelu_path("cublaslt"):
        assert _C._set_cuda_gelu_path("cublaslt") == "cublaslt"
    assert _C._set_cuda_gelu_path("kernel") == "kernel"  # the default, restored


@pytest.mark.parametrize("device", devices())
def test_cuda_lt_and_fallback_paths_match_reference(device):
    if device == "cpu":
        pytest.skip("exercises the CUDA cuBLASLt epilogue and the default path")
    from parallel_layers import _C
    # (dtype, approximate, N, x offset, weight offset in elements, path) with the cuBLASLt path
    # asked for: tanh + 16-bit + N, K % 8 == 0 + 16-byte aligned -> cuBLASLt GELU_AUX_BIAS,
    # including 16-byte aligned views that are not 256-byte aligned (cuBLASLt's default
    # assumption); float32, exact erf, N = 1, float64 or a 2-byte aligned view -> addmm + our GeLU.
    cases = [(torch.bfloat16, "tanh", 64, 0, 0, "lt"), (torch.float16, "tanh", 64, 0, 0, "lt"),
             (torch.float32, "tanh", 64, 0, 0, "kernel"), (torch.bfloat16, "tanh", 64, 8, 8, "lt"),
             (torch.float16, "tanh", 64, 4, 12, "kernel"), (torch.bfloat16, "tanh", 64, 1, 0, "kernel"),
             (torch.bfloat16, "none", 64, 0, 0, "kernel"), (torch.float32, "none", 64, 0, 0, "kernel"),
             (torch.bfloat16, "tanh", 1, 0, 0, "kernel"), (torch.float64, "tanh", 8, 0, 0, "kernel")]
    for setting in ("cublaslt", "kernel"):
        for dtype, approximate, n, x_off, w_off, path in cases:
            x, w, b = _inputs((33, 40), n, dtype, "cuda")
            x, w = _offset_view(x, x_off), _offset_view(w, w_off)
            calls = _C._cuda_lt_matmul_calls()
            with cuda_gelu_path(setting):
                y, pre = torch.ops.parallel_layers.linear_gelu(x, w, b, approximate, True)
            took = "lt" if _C._cuda_lt_matmul_calls() > calls else "kernel"
            case = (setting, dtype, approximate, n, x_off, w_off)
            assert took == (path if setting == "cublaslt" else "kernel"), f"{case}: took the {took} path"
            y_ref, pre_ref = _reference(x, w, b, approximate)
            eager = F.gelu(F.linear(x, w, b), approximate=approximate)
            # No worse than twice the eager CUDA result in the same dtype (TF32 settings alike).
            assert max_abs_error(y, y_ref) <= 2 * max_abs_error(eager, y_ref) + 1e-12, case
            assert max_abs_error(pre, pre_ref) <= 2 * max_abs_error(F.linear(x, w, b), pre_ref) + 1e-12, case


@pytest.mark.parametrize("device", devices())
def test_cuda_lt_path_follows_matmul_settings(device):
    """Note [cuBLASLt under torch.backends.cuda.matmul]: with the cuBLASLt path asked for and
    reduced-precision split-K reductions turned off (and split-K too) it still runs, within twice eager's error
    under the same setting; float16 accumulation, which it does not express, takes the addmm
    fallback."""
    if device == "cpu":
        pytest.skip("exercises the CUDA cuBLASLt epilogue")
    from parallel_layers import _C
    matmul = torch.backends.cuda.matmul
    saved = {name: getattr(matmul, name) for name in
             ("allow_fp16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction_split_k",
              "allow_bf16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction_split_k",
              "allow_fp16_accumulation")}

    def path_and_check(dtype):
        x, w, b = _inputs((300, 2048), 64, dtype, "cuda")  # long K: where split-K would be picked
        calls = _C._cuda_lt_matmul_calls()
        y, pre = torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", True)
        took = "lt" if _C._cuda_lt_matmul_calls() > calls else "fallback"
        y_ref, pre_ref = _reference(x, w, b, "tanh")
        eager = F.gelu(F.linear(x, w, b), approximate="tanh")
        assert max_abs_error(y, y_ref) <= 2 * max_abs_error(eager, y_ref) + 1e-12, (dtype, took)
        assert max_abs_error(pre, pre_ref) <= 2 * max_abs_error(F.linear(x, w, b), pre_ref) + 1e-12, (dtype, took)
        return took

    try:
        with cuda_gelu_path("cublaslt"):
            for setting in (True, False, (False, False)):
                matmul.allow_fp16_reduced_precision_reduction = setting
                matmul.allow_bf16_reduced_precision_reduction = setting
                for dtype in (torch.float16, torch.bfloat16):
                    assert path_and_check(dtype) == "lt", (setting, dtype)
            matmul.allow_fp16_accumulation = True
            assert path_and_check(torch.float16) == "fallback"
    finally:
        matmul.allow_fp16_reduced_precision_reduction = (saved["allow_fp16_reduced_precision_reduction"],
                                                         saved["allow_fp16_reduced_precision_reduction_split_k"])
        matmul.allow_bf16_reduced_precision_reduction = (saved["allow_bf16_reduced_precision_reduction"],
                                                         saved["allow_bf16_reduced_precision_reduction_split_k"])
        matmul.allow_fp16_accumulation = saved["allow_fp16_accumulation"]


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda: (torch.randn(3, 4), torch.randn(5, 6), None), r"x has 4 features in its last dim \(shape \[3, 4\]\) "
                                                              r"but weight expects in_features = 6"),
        (lambda: (torch.randn(3, 4), torch.randn(5, 4, 1), None), r"weight must be 2-D \[out_features, in_features\]"),
        (lambda: (torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), r"bias must have shape \[5\]"),
        (lambda: (torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64), None),
         "x has dtype Float but weight has dtype Double"),
    ],
)
def test_bad_input_messages(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.parallel_layers.linear_gelu(*args(), "tanh", True)


def test_bad_approximate_message():
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh', got 'erf'"):
        linear_gelu(torch.randn(2, 3), torch.randn(4, 3), None, "erf")


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bfloat16")
@pytest.mark.parametrize("approximate", APPROX)
def test_bfloat16_inference_uses_the_onednn_post_op(approximate):
    # Note [bfloat16 inference through oneDNN] in csrc/linear_gelu.cpp: bit-equal to oneDNN's
    # fused op when nothing is kept for backward; training keeps its own path (and z).
    x, w, b = _inputs((33, 40), 24, torch.bfloat16, "cpu")
    y, z = torch.ops.parallel_layers.linear_gelu(x, w, b, approximate, False)
    assert z.numel() == 0
    assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], approximate))
    y_train, z_train = torch.ops.parallel_layers.linear_gelu(x, w, b, approximate, True)
    assert torch.equal(z_train, F.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bfloat16_gemms_widen_where_onednn_has_no_bfloat16(dtype):
    """Note [bfloat16 GEMM without oneDNN]: where ATen's bfloat16 GEMM has no oneDNN kernel, the
    op's GEMMs (forward with its bias, dx, dW, linear_weight_grad) are float32 products rounded
    once; elsewhere, and for the other dtypes, ATen's GEMM of the dtype, with no conversion."""
    x, w, b = _inputs((64, 300), 96, dtype, "cpu")
    dy = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    widens = BF16_GEMMS_WIDEN and dtype == torch.bfloat16
    f32 = lambda t: t.float()  # noqa: E731
    _, z = torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", True)
    dx, dw, _ = torch.ops.parallel_layers.linear_gelu_backward(dy, x, w, z, "tanh", [True, True, True])
    dz, _ = bias_gelu_backward(dy, z, "tanh")  # the dz the fused backward computes
    if widens:
        assert torch.equal(z, torch.addmm(f32(b), f32(x), f32(w).t()).to(dtype))
        assert torch.equal(dx, (f32(dz) @ f32(w)).to(dtype))
        assert torch.equal(dw, (f32(dz).t() @ f32(x)).to(dtype))
        assert torch.equal(linear_weight_grad(dy, x), (f32(dy).t() @ f32(x)).to(dtype))
        assert conversions_inside(lambda: linear_weight_grad(dy, x)) == 3  # two operands widened, dW narrowed
    else:
        assert torch.equal(z, fp32_linear(x, w, b))  # F.linear but where float32 goes through oneDNN
        assert conversions_inside(lambda: linear_weight_grad(dy, x)) == 0
        assert conversions_inside(lambda: torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", True)) == 0


@pytest.mark.parametrize("setting", ["auto", "aten", "onednn"])
def test_float32_gemms_follow_the_cpu_gemm_rule(setting):
    """Note [float32 GEMMs through oneDNN]: the forward (bias included) and dx GEMMs are the bits
    of the library the setting picks - "auto": oneDNN exactly on AMD CPUs with AVX-512 - and the
    weight gradient stays ATen's; float64 always ATen's."""
    x, w, b = _inputs((64, 40), 24, torch.float32, "cpu")
    dy = torch.randn(64, 24, generator=torch.Generator().manual_seed(3))
    onednn = setting == "onednn" or (setting == "auto" and FP32_GEMMS_ONEDNN)
    with cpu_gemm(setting):
        _, z = torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", True)
        dx, dw, _ = torch.ops.parallel_layers.linear_gelu_backward(dy, x, w, z, "tanh", [True, True, False])
        dz, _ = bias_gelu_backward(dy, z, "tanh")
        assert torch.equal(z, fp32_linear(x, w, b, setting))
        dx_onednn = torch.ops.mkldnn._linear_pointwise(dz, w.t(), None, "none", [], "")
        assert torch.equal(dx, dx_onednn if onednn else dz @ w)
        assert torch.equal(dx, linear_input_grad(dz, w))
        assert torch.equal(dw, dz.t() @ x)
        x64, w64, b64 = (t.double() for t in (x, w, b))
        assert torch.equal(torch.ops.parallel_layers.linear_gelu(x64, w64, b64, "tanh", True)[1], F.linear(x64, w64, b64))
    # The ATen and oneDNN products differ only in summation order.
    assert _rel_error(fp32_linear(x, w, b, "onednn"), F.linear(x.double(), w.double(), b.double())) < F32_RTOL


def test_cpu_gemm_setting_refuses_unknown_names():
    with pytest.raises(RuntimeError, match=r"CPU GEMM backend must be 'auto', 'aten' or 'onednn' "
                                           r"\(PARALLEL_LAYERS_CPU_GEMM\), got 'mkl'"):
        parallel_layers._C._set_cpu_gemm("mkl")
    with cpu_gemm("onednn"):  # a refused name leaves the setting as it was
        with pytest.raises(RuntimeError, match="got ''"):
            parallel_layers._C._set_cpu_gemm("")
        assert parallel_layers._C._set_cpu_gemm("onednn") == "onednn"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dz_shape, k", [((0, 5), 3), ((7, 5), 1), ((2, 3, 17), 33), ((130, 64), 48)])
def test_linear_input_grad_matches_float64(dz_shape, k, dtype, device):
    g = torch.Generator().manual_seed(11)
    dz = torch.randn(dz_shape, generator=g, dtype=torch.float64)
    w = torch.randn(dz_shape[-1], k, generator=g, dtype=torch.float64)
    ref = dz @ w
    for gemm in (["aten", "onednn"] if device == "cpu" and dtype == torch.float32 else ["auto"]):
        with cpu_gemm(gemm):
            got = linear_input_grad(dz.to(device, dtype), w.to(device, dtype))
        assert got.shape == ref.shape and got.dtype == dtype
        # float32 / float64: the GEMM's own rounding (~sqrt(n) eps); bfloat16: the inputs' rounding
        # to 8 bits dominates, 2^-8 relative per factor.
        bound = {torch.float32: F32_RTOL, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
        assert _rel_error(got.cpu(), ref) < bound
    torch.library.opcheck(torch.ops.parallel_layers.linear_input_grad.default,
                          (dz.to(device, dtype), w.to(device, dtype)))


@pytest.mark.parametrize("args, message", [
    (lambda: (torch.randn(3, 4), torch.randn(5, 2)),
     r"linear_input_grad: grad_out \[..., n\] and weight \[n, k\] must agree on n; got grad_out \[3, 4\] and weight \[5, 2\]"),
    (lambda: (torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64)), r"dtype"),
])
def test_linear_input_grad_bad_input_messages(args, message):
    with pytest.raises(RuntimeError, match=message):
        linear_input_grad(*args())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape, n", [((0, 5), 3), ((7, 0), 4), ((7, 5), 1), ((2, 3, 17), 33), ((130, 64), 48)])
def test_linear_forward_matches_float64_and_the_gemm_rules(x_shape, n, dtype, device):
    """linear_forward is F.linear's value by the fused ops' forward GEMM rules: the bits of the
    library the float32 rule picks (both, on any CPU), a float32 product rounded once where
    bfloat16 GEMMs widen, F.linear's bits everywhere else; as close to float64 as the GEMM."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    w = torch.randn(n, x_shape[-1], generator=g, dtype=torch.float64) / max(x_shape[-1], 1) ** 0.5
    b = torch.randn(n, generator=g, dtype=torch.float64)
    for bias in (b, None):
        ref = F.linear(x, w, bias)
        cast = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
        for gemm in (["aten", "onednn"] if device == "cpu" and dtype == torch.float32 else ["auto"]):
            with cpu_gemm(gemm):
                got = linear_forward(cast(x), cast(w), cast(bias))
            assert got.shape == ref.shape and got.dtype == dtype
            if device == "cpu" and dtype == torch.float32:
                expected = fp32_linear(cast(x), cast(w), cast(bias), gemm)
            elif device == "cpu" and dtype == torch.bfloat16 and BF16_GEMMS_WIDEN:
                expected = F.linear(x.to(dtype).float(), w.to(dtype).float(),
                                    None if bias is None else bias.to(dtype).float()).to(dtype)
            else:
                expected = F.linear(cast(x), cast(w), cast(bias))
            assert torch.equal(got, expected)
            bound = {torch.float32: F32_RTOL, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
            assert _rel_error(got.cpu(), ref) < bound
        torch.library.opcheck(torch.ops.parallel_layers.linear_forward.default, (cast(x), cast(w), cast(bias)))


@pytest.mark.skipif(BF16_GEMMS_WIDEN, reason="this CPU's oneDNN has no bfloat16 (its GEMMs widen instead)")
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_forward_gemms_through_onednn_linear(bias):
    """Note [bfloat16 forward GEMM through oneDNN]: where ATen's oneDNN supports bfloat16, the
    forward GEMMs - linear_forward, and linear_gelu's and linear_swiglu's forwards that keep the
    pre-activation - are one oneDNN linear each (the bias in its epilogue, not copied into the
    output first as ATen's addmm does), and give F.linear's bits."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 37, 40, generator=g).to(torch.bfloat16)
    w = (torch.randn(112, 40, generator=g) / 40 ** 0.5).to(torch.bfloat16)
    b = torch.randn(112, generator=g).to(torch.bfloat16) if bias else None
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    assert torch.equal(onednn, F.linear(x, w, b))
    calls = {
        "linear_forward": lambda: linear_forward(x, w, b),
        "linear_gelu": lambda: torch.ops.parallel_layers.linear_gelu(x, w, b, "tanh", True)[1],
        "linear_swiglu": lambda: torch.ops.parallel_layers.linear_swiglu(x, w, b, True)[1],
    }
    for name, call in calls.items():
        assert torch.equal(call(), onednn), name
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        names = [e.name for e in prof.events()]
        assert names.count("mkldnn::_linear_pointwise") == 1 and "aten::addmm" not in names, (name, names)


@pytest.mark.parametrize("args, message", [
    (lambda: (torch.randn(3, 4), torch.randn(5, 2), None),
     r"x has 4 features in its last dim \(shape \[3, 4\]\) but weight expects in_features = 2"),
    (lambda: (torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), r"bias must have shape \[5\]"),
    (lambda: (torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64), None), r"dtype"),
])
def test_linear_forward_bad_input_messages(args, message):
    with pytest.raises(RuntimeError, match=message):
        linear_forward(*args())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("gemm", ["aten", "onednn"])
def test_gemm_ops_keep_their_dtype_and_bits_under_autocast(device, gemm):
    """Note [no autocast inside the ops]: inside a torch.autocast region the backward GEMM ops
    compute in their operands' dtype (autocast would send ATen's mm to the low-precision dtype),
    the fused backward ops likewise, and linear_forward casts its inputs as F.linear does, then
    gives the bits it gives on the cast inputs outside the region."""
    low = torch.bfloat16 if device == "cpu" else torch.float16
    g = torch.Generator().manual_seed(13)
    x, dz = torch.randn(24, 16, generator=g).to(device), torch.randn(24, 40, generator=g).to(device)
    w, b = torch.randn(40, 16, generator=g).to(device), torch.randn(40, generator=g).to(device)
    z = torch.randn(24, 40, generator=g).to(device)
    calls = {
        "linear_weight_grad": lambda: linear_weight_grad(dz, x),
        "linear_input_grad": lambda: linear_input_grad(dz, w),
        "linear_gelu_backward": lambda: torch.ops.parallel_layers.linear_gelu_backward(dz, x, w, z, "tanh",
                                                                                       [True, True, True]),
        "linear_swiglu_backward": lambda: torch.ops.parallel_layers.linear_swiglu_backward(
            dz[:, :20], x, w, z, [True, True, True]),
    }
    with cpu_gemm(gemm):
        for name, call in calls.items():
            outside = call()
            with torch.autocast(device, dtype=low):
                inside = call()
            for o, i in zip(outside if isinstance(outside, tuple) else [outside],
                            inside if isinstance(inside, tuple) else [inside]):
                assert i.dtype == torch.float32 and torch.equal(i, o), name
        with torch.autocast(device, dtype=low):
            y = linear_forward(x, w, b)
        assert y.dtype == low and torch.equal(y, linear_forward(x.to(low), w.to(low), b.to(low)))


def test_cpu_gemm_environment_variable_is_checked():
    """PARALLEL_LAYERS_CPU_GEMM is read once, at the first float32 GEMM; a bad value is an error
    there that names it and the valid ones, never a silent default."""
    probe = ("import torch, parallel_layers\n"
             "x, w = torch.randn(4, 8), torch.randn(6, 8)\n"
             "torch.ops.parallel_layers.linear_swiglu(x, w, None, False)\n")
    env = {**os.environ, "PARALLEL_LAYERS_CPU_GEMM": "mkl"}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "CPU GEMM backend must be 'auto', 'aten' or 'onednn' (PARALLEL_LAYERS_CPU_GEMM), got 'mkl'" in r.stderr
    env["PARALLEL_LAYERS_CPU_GEMM"] = "aten"
    r = subprocess.run([sys.executable, "-c", probe + "print(parallel_layers._C._fp32_cpu_gemm())"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1] == "aten", r.stderr
