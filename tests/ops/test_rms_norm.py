"""rms_norm / rms_norm_add / rms_norm_backward against a float64 reference and against Hugging Face's
LlamaRMSNorm (and Qwen2's, Mistral's); opcheck, gradcheck, hypothesis, torch.compile; FusedRMSNorm."""

import itertools

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import parallel_layers  # noqa: F401  (registers the ops)
from parallel_layers.ops import FusedRMSNorm, rms_norm, rms_norm_add, rms_norm_backward
from tests.ops.numerics import assert_within_rounding, devices, max_abs_error

EPS = 1e-6
# Degenerate sizes, odd sizes, 3-D, and one large enough that the CPU backward splits its rows
# into several chunks (>= 64K elements each) run by several threads.
SHAPES = [(0, 5), (5, 0), (1, 1), (7, 13), (3, 4, 33), (1, 300), (300, 1), (600, 257)]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device, seed=0, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    # Row scales over 4 decades: the normalisation, not the values, must set the output's size.
    scale = 10 ** (4 * torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) - 2)
    x = (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(device, w_dtype or dtype)
    return x, w


def hf_rms_norm(x, weight, eps):
    """LlamaRMSNorm.forward (transformers/models/llama/modeling_llama.py), as a function."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _reference(x, w, eps):
    """The module's math in float64, without its intermediate rounding of h: (y, h)."""
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return w.double() * h, h


def _ulps(n):
    # Sums of n terms accumulate rounding ~sqrt(n) ulps at worst-case-typical rates (float64
    # rows sum in float64; float32 rows in float64, so for them this is loose); 4 ulps cover
    # the roundings of rstd, h and y.
    return 4 + n ** 0.5


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64(shape, dtype, device):
    x, w = _inputs(shape, dtype, device)
    y, rstd = torch.ops.parallel_layers.rms_norm(x, w, EPS)
    y_ref, _ = _reference(x, w, EPS)
    assert y.dtype == dtype and rstd.dtype == dtype and rstd.shape == x.shape[:-1]
    assert_within_rounding(y, y_ref, torch.zeros_like(y_ref), ulps=_ulps(shape[-1]), what="y")
    if shape[-1] > 0:
        rstd_ref = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
        assert_within_rounding(rstd, rstd_ref, torch.zeros_like(rstd_ref), ulps=_ulps(shape[-1]), what="rstd")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_float64(shape, dtype, device):
    x, w = _inputs(shape, dtype, device)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device, dtype)
    x.requires_grad_(), w.requires_grad_()
    rms_norm(x, w, EPS).backward(dy)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64, h = _reference(x64, w64, EPS)
    y64.backward(dy.double())
    n = max(shape[-1], 1)
    rstd = torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + EPS)
    g = (dy.double() * w64.detach()).abs()
    h = h.detach().abs()
    # dx = rstd (g - h mean(g h)): the terms' sizes, not the (possibly cancelling) difference.
    scale = rstd * (g + h * (g * h).sum(-1, keepdim=True) / n)
    assert_within_rounding(x.grad, x64.grad, scale, ulps=_ulps(shape[-1]), what="grad x")
    # dweight sums rows of dy * h: relative to the sum of the terms' sizes.
    rows = x.numel() // shape[-1] if shape[-1] else 0
    row_scale = (dy.double().abs() * h).reshape(rows, shape[-1]).sum(0)
    assert_within_rounding(w.grad, w64.grad, row_scale, ulps=_ulps(rows), what="grad weight")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("w_dtype", ["same", torch.float32])
def test_16bit_no_worse_than_the_hf_module(dtype, w_dtype, device):
    w_dtype = dtype if w_dtype == "same" else w_dtype
    x, w = _inputs((129, 257), dtype, device, w_dtype=w_dtype)
    out_dtype = torch.promote_types(dtype, w_dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, out_dtype)
    results = []
    for fn in (rms_norm, hf_rms_norm):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xg, wg, EPS)
        y.backward(dy)
        results.append((y.detach(), xg.grad, wg.grad))
    ours, eager = results
    assert [t.dtype for t in ours] == [t.dtype for t in eager]
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64, _ = _reference(x64, w64, EPS)
    y64.backward(dy.double())
    for name, o, e, r in zip(("y", "grad x", "grad weight"), ours, eager, (y64, x64.grad, w64.grad)):
        # Our math runs in float32 and rounds once at the end (the module rounds h, as we do,
        # and its gradient chain several times more); 2x leaves room for ties rounded apart.
        assert max_abs_error(o, r) <= 2 * max_abs_error(e, r), name


@pytest.mark.parametrize("device", devices())
def test_float32_matches_the_hf_module(device):
    """Same formula and roundings as the module; the sums of squares differ only in order (ours
    float64, so correctly rounded to float32), so most rows are bitwise the module's, and the
    others as close to float64 as the module's."""
    x, w = _inputs((256, 1024), torch.float32, device)
    y = rms_norm(x, w, EPS)
    ref = hf_rms_norm(x, w, EPS)
    same_rows = (y == ref).all(-1)
    assert same_rows.sum() > len(same_rows) / 2, f"only {int(same_rows.sum())} of {len(same_rows)} rows bitwise equal"
    y64, _ = _reference(x, w, EPS)
    # Both errors are mostly the roundings of h and y, which an ulp of rstd can tip either way.
    assert max_abs_error(y, y64) <= 2 * max_abs_error(ref, y64)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_is_the_norm_of_the_rounded_sum(dtype, device):
    x, w = _inputs((37, 65), dtype, device)
    res, _ = _inputs((37, 65), dtype, device, seed=1)
    y, s = rms_norm_add(x, res, w, EPS)
    assert torch.equal(s, res + x)  # rounded once to the dtype, as the decoder's `residual + hidden_states`
    assert torch.equal(y, rms_norm(res + x, w, EPS))


@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    x, w = _inputs((6, 7), torch.float64, device)
    res, _ = _inputs((6, 7), torch.float64, device, seed=1)
    x.requires_grad_(), w.requires_grad_(), res.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, EPS), (x, w))
    # Both outputs of the add variant used downstream, and each alone.
    for use in ((0, 1), (0,), (1,)):
        assert torch.autograd.gradcheck(
            lambda x, r, w: sum(rms_norm_add(x, r, w, EPS)[i].sin().sum() for i in use), (x, res, w))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_property_add_forward_and_backward_match_float64(rows, n, dtype, seed):
    x, w = _inputs((rows, n), dtype, "cpu", seed=seed)
    res, _ = _inputs((rows, n), dtype, "cpu", seed=seed + 1)
    dy, ds = (torch.randn(rows, n, generator=torch.Generator().manual_seed(seed + k)).to(dtype) for k in (2, 3))
    y, s, rstd = torch.ops.parallel_layers.rms_norm_add(x, res, w, EPS)
    dx, dw = rms_norm_backward(dy, s, w, rstd, ds)
    s64 = s.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64, h = _reference(s64, w64, EPS)
    torch.autograd.backward([y64, s64], [dy.double(), ds.double()])
    # 16-bit: h and y each round to 8 (bfloat16) bits; the float32 math under them is ~exact.
    ulps = _ulps(n) if dtype == torch.float32 else 2
    assert_within_rounding(y, y64, torch.zeros_like(y64), ulps=ulps, what="y")
    rstd64 = torch.rsqrt(s64.detach().pow(2).mean(-1, keepdim=True) + EPS)
    g, hh = (dy.double() * w64.detach()).abs(), h.detach().abs()
    scale = rstd64 * (g + hh * (g * hh).mean(-1, keepdim=True)) + ds.double().abs()
    assert_within_rounding(dx, s64.grad, scale, ulps=ulps, what="dx")
    # dweight multiplies dy by the rounded h: half an ulp of h per term, summed in float32.
    row_scale = (dy.double().abs() * hh).sum(0)
    assert_within_rounding(dw, w64.grad, row_scale, ulps=_ulps(rows) if dtype == torch.float32 else 1, what="dw")


def test_weight_gradient_is_a_plain_sum_independent_of_threads():
    """dweight of all rows = the sum of the dweights of row slices (what sequence parallelism's
    all-reduce over the tensor-parallel group adds up), and its bits do not depend on the thread
    count (the chunking is fixed by the shape)."""
    x, w = _inputs((600, 300), torch.float32, "cpu")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    _, rstd = torch.ops.parallel_layers.rms_norm(x, w, EPS)
    threads = torch.get_num_threads()
    try:
        per_threads = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            per_threads.append(rms_norm_backward(dy, x, w, rstd))
    finally:
        torch.set_num_threads(threads)
    for dx, dw in per_threads[1:]:
        assert torch.equal(dx, per_threads[0][0]) and torch.equal(dw, per_threads[0][1])
    full = per_threads[0][1]
    halves = sum(rms_norm_backward(dy[i], x[i], w, rstd[i])[1].double() for i in (slice(0, 250), slice(250, None)))
    row_scale = (dy * x * rstd[:, None]).abs().double().sum(0)
    assert_within_rounding(full, halves, row_scale, ulps=_ulps(600), what="sum of the row slices' dweight")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 3), (2, 3, 5)])
def test_opcheck(shape, dtype, device):
    x, w = _inputs(shape, dtype, device)
    res, _ = _inputs(shape, dtype, device, seed=1)
    for weight in (w,) if dtype == torch.float32 else (w, w.float()):  # and a float32 weight of 16-bit x
        xs, ws, rs = (t.clone().requires_grad_(dtype == torch.float32) for t in (x, weight, res))
        torch.library.opcheck(torch.ops.parallel_layers.rms_norm.default, (xs, ws, EPS))
        torch.library.opcheck(torch.ops.parallel_layers.rms_norm_add.default, (xs, rs, ws, EPS))
        y, s, rstd = torch.ops.parallel_layers.rms_norm_add(x, res, weight, EPS)
        torch.library.opcheck(torch.ops.parallel_layers.rms_norm_backward.default, (torch.ones_like(y), s, weight,
                                                                                    rstd, torch.ones_like(s)))


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    def f(x, r, w):
        y, s = rms_norm_add(x * 2, r, w, EPS)
        return (rms_norm(y, w, EPS) * s).sum()

    x, w = _inputs((8, 16), torch.float32, device)
    r, _ = _inputs((8, 16), torch.float32, device, seed=1)
    x.requires_grad_(), w.requires_grad_(), r.requires_grad_()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
    grads = torch.autograd.grad(out, (x, r, w))
    expected = f(x, r, w)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, r, w))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_input(device):
    x = torch.randn(33, 20, dtype=torch.float64, device=device).t()  # [20, 33], strides (1, 20)
    w = torch.randn(33, dtype=torch.float64, device=device)
    y, rstd = torch.ops.parallel_layers.rms_norm(x, w, EPS)
    assert y.is_contiguous()
    torch.testing.assert_close(y, _reference(x, w, EPS)[0], rtol=1e-14, atol=0)  # ~10 float64 roundings


# ---- FusedRMSNorm and the Hugging Face modules ------------------------------------------------
def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # trained-looking norm weights, not ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _swap_norms(model):
    """Every RMSNorm of model replaced by a FusedRMSNorm sharing its weight; returns how many."""
    names = [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, FusedRMSNorm.from_hf(model.get_submodule(name)))
    return len(names)


def test_tiny_llama_with_fused_norms_matches_the_hf_model():
    import copy

    model = _tiny_llama()
    fused = copy.deepcopy(model)
    assert _swap_norms(fused) == 2 * 2 + 1  # two per decoder layer and the final one
    assert fused.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, fused)]
    for loss in losses:
        loss.backward()
    # float32 throughout: the norms agree with the module's to an ulp or two (the sums' order),
    # which the layers after them carry on at float32 precision.
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[1], losses[0], **tol)
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_from_hf_matches_each_family_norm(family):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "mistral": "MistralRMSNorm"}[family])
    hf = cls(48, eps=1e-5)
    x, w = _inputs((5, 48), torch.float32, "cpu")
    with torch.no_grad():
        hf.weight.copy_(w)
    fused = FusedRMSNorm.from_hf(hf)
    assert fused.weight is hf.weight and fused.variance_epsilon == hf.variance_epsilon
    assert repr(fused).endswith(repr(hf).split("(", 1)[1])
    results = []
    for m in (hf, fused):
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xg.grad, m.weight.grad.clone()))
        m.weight.grad = None
    # float32 roundings in another order: a few ulps; dx cancels where g ~ h mean(g h), so an
    # absolute term at the size of its terms (~1) too.
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_from_hf_shares_a_meta_or_memory_mapped_weight(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with torch.device("meta"):
        meta = LlamaRMSNorm(64)
    fused = FusedRMSNorm.from_hf(meta)
    assert fused.weight is meta.weight
    y = fused(torch.empty(3, 64, device="meta", dtype=torch.bfloat16))
    assert y.shape == (3, 64) and y.dtype == torch.float32 and y.device.type == "meta"  # float32 weight promotes

    torch.save({"weight": torch.randn(64)}, tmp_path / "norm.pt")
    hf = LlamaRMSNorm(64)
    hf.load_state_dict(torch.load(tmp_path / "norm.pt", mmap=True), assign=True)
    fused = FusedRMSNorm.from_hf(hf)
    assert fused.weight is hf.weight
    x = torch.randn(4, 64)
    torch.testing.assert_close(fused(x), hf(x), rtol=4 * torch.finfo(torch.float32).eps, atol=0)  # sums' order


def test_autocast_needs_no_policy():
    """Inside autocast the module's ops are not cast (its math is float32 already), so its output
    has the dtype `weight * h` promotes to: float32 for a 16-bit activation and a float32 weight.
    The op does the same without an autocast kernel, with the same values and gradient dtypes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(40)
    x, w = _inputs((6, 40), torch.bfloat16, "cpu", w_dtype=torch.float32)
    with torch.no_grad():
        hf.weight.copy_(w)
    results = []
    for m in (hf, FusedRMSNorm.from_hf(hf)):
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xg)
        y.sum().backward()
        results.append((y.detach(), xg.grad, m.weight.grad.clone()))
        m.weight.grad = None
    assert [t.dtype for t in results[1]] == [t.dtype for t in results[0]] == [torch.float32, torch.bfloat16,
                                                                              torch.float32]
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)  # h rounds to bfloat16 in both
    for ours, theirs in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(ours, theirs, rtol=2 ** -7, atol=2 ** -7)  # a bfloat16 ulp: g unrounded in ours


def test_from_hf_refuses_other_norms():
    with pytest.raises(TypeError, match=r"RMSNorm of the Llama form.*LayerNorm has weight of shape \(8,\) and "
                                        r"variance_epsilon None"):
        FusedRMSNorm.from_hf(nn.LayerNorm(8))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(3, 4), torch.randn(5)), r"weight must have shape \[4\] \(the last dim of x \[3, 4\]\), "
                                                      r"got \[5\]"),
        (lambda: (torch.randn(3, 4), torch.randn(4, dtype=torch.float64)),
         "weight of dtype Double with x of dtype Float would give a Double output"),
        (lambda: (torch.ones(3, 4, dtype=torch.int32), torch.ones(4)),
         "x must be float32, float64, float16 or bfloat16, got Int"),
        (lambda: (torch.tensor(1.0), torch.randn(1)), r"x must have at least 1 dimension, got shape \[\]"),
    ],
)
def test_bad_input_messages(make, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.parallel_layers.rms_norm(*make(), EPS)


def test_add_and_backward_bad_input_messages():
    with pytest.raises(RuntimeError, match=r"residual has shape \[3, 5\] but x has shape \[3, 4\]"):
        rms_norm_add(torch.randn(3, 4), torch.randn(3, 5), torch.randn(4), EPS)
    with pytest.raises(RuntimeError, match="x has dtype BFloat16 but residual has dtype Float"):
        rms_norm_add(torch.randn(3, 4).bfloat16(), torch.randn(3, 4), torch.randn(4), EPS)
    x, w = torch.randn(3, 4).bfloat16(), torch.randn(4)
    _, rstd = torch.ops.parallel_layers.rms_norm(x, w, EPS)
    with pytest.raises(RuntimeError, match=r"grad_y must be like the forward output, shape \[3, 4\] dtype Float"):
        rms_norm_backward(torch.randn(3, 4).bfloat16(), x, w, rstd)
    with pytest.raises(RuntimeError, match=r"rstd must be the forward's, shape \[3\] dtype Float; got shape \[4\]"):
        rms_norm_backward(torch.randn(3, 4), x, w, rstd.new_empty(4))


@pytest.mark.parametrize("device", devices())
def test_cuda_matches_cpu(device):
    if device == "cpu":
        pytest.skip("compares the CUDA kernels with the CPU ones")
    # Row widths for each backward kernel: columns per thread held in registers 8, 1, 4, 2 and 8
    # filled exactly, and wider than those (the loop kernel), Note [rms_norm backward in registers].
    for (dtype, w_dtype), shape in itertools.product(
            ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float64, torch.float64)),
            ((300, 1029), (37, 130), (20, 600), (40, 300), (8, 2048), (9, 4096))):
        x, w = _inputs(shape, dtype, "cpu", w_dtype=w_dtype)
        res, _ = _inputs(shape, dtype, "cpu", seed=1)
        dy = torch.randn(x.shape).to(torch.promote_types(dtype, w_dtype))
        cpu = torch.ops.parallel_layers.rms_norm_add(x, res, w, EPS)
        gpu = torch.ops.parallel_layers.rms_norm_add(x.cuda(), res.cuda(), w.cuda(), EPS)
        # rsqrtf (2 ulps) and the sums' order move float32 results by a few ulps (2.7 seen on an
        # H200), and can move a 16-bit result to its neighbour: one ulp of the dtype.
        ulps = 8 if dtype in (torch.float32, torch.float64) else 2
        tol = dict(rtol=ulps * torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps)
        for c, g in zip(cpu, gpu):
            torch.testing.assert_close(g.cpu(), c, **tol)
        for grad_sum in (res, None):  # with and without the residual stream's gradient
            cpu_b = rms_norm_backward(dy, cpu[1], w, cpu[2], grad_sum)
            gpu_b = rms_norm_backward(dy.cuda(), cpu[1].cuda(), w.cuda(), cpu[2].cuda(),
                                      None if grad_sum is None else grad_sum.cuda())
            for c, g in zip(cpu_b, gpu_b):
                torch.testing.assert_close(g.cpu(), c, rtol=4 * torch.finfo(dtype).eps, atol=1e-4)  # sums' order


@pytest.mark.parametrize("device", devices())
def test_cuda_forward_where_its_grid_wraps(device):
    """The forward launches at most 65535 * 16 blocks, one row each, and loops over the rows
    beyond (csrc/cuda/rms_norm_kernels.cu): 1,048,577 rows of 8 run that loop; every row's
    output and rstd against the CPU kernels' (review helper 42: no test reached it)."""
    if device == "cpu":
        pytest.skip("compares the CUDA kernels with the CPU ones")
    rows = 65535 * 16 + 17
    x, w = _inputs((rows, 8), torch.float32, "cpu")
    res, _ = _inputs((rows, 8), torch.float32, "cpu", seed=1)
    cpu = torch.ops.parallel_layers.rms_norm_add(x, res, w, EPS)
    gpu = torch.ops.parallel_layers.rms_norm_add(x.cuda(), res.cuda(), w.cuda(), EPS)
    tol = dict(rtol=8 * torch.finfo(torch.float32).eps, atol=torch.finfo(torch.float32).eps)
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, **tol)

