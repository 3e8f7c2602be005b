"""Every branch of the autograd kernels (csrc/autograd.cpp, Note [autograd in C++]) against
float64 finite differences: each output used alone and together (an unused output's gradient
arrives undefined), the pre-activation recomputed when it was not kept, no bias, a 1-D input.
Without a gradient to compute, no graph is recorded and the values are the same. And the ops
without a derivative (Note [ops without a derivative]): a second-order gradient
through a fused op raises, naming its backward op, instead of coming back as None."""

import pytest
import torch

import parallel_layers.ops  # noqa: F401  (loads the ops and their fake kernels)
from tests.ops.numerics import devices

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
# The shape of each input name in CASES.
SHAPES = {"x": (3, 5), "w": (4, 5), "b": (4,), "w2": (8, 5), "b2": (8,), "c": (5,), "v": (5,), "r": (3, 5), "g": (5,)}


@pytest.mark.parametrize("case", list(CASES))
def test_autograd_kernel_branches_match_finite_differences(case):
    g = torch.Generator().manual_seed(0)
    fn, names = CASES[case]
    inputs = tuple(torch.randn(*SHAPES[n], generator=g, dtype=torch.float64).requires_grad_() for n in names.split())
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


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", list(CASES))
def test_no_graph_is_recorded_without_a_gradient_to_compute(case, device):
    """Note [no autograd node without a graph to record]: under no_grad, or on inputs none of
    which requires grad, the differentiable ops run below autograd: the same values, no grad_fn."""
    g = torch.Generator().manual_seed(2)
    fn, names = CASES[case]
    inputs = [torch.randn(*SHAPES[n], generator=g, dtype=torch.float64).to(device) for n in names.split()]
    recorded = fn(*(t.clone().requires_grad_() for t in inputs))
    assert recorded.requires_grad
    with torch.no_grad():
        no_grad = fn(*(t.clone().requires_grad_() for t in inputs))
    plain = fn(*inputs)
    for out in (no_grad, plain):
        assert not out.requires_grad and out.grad_fn is None
        assert torch.equal(out, recorded.detach())


# Each differentiable op with the backward op its backward calls (the one a double backward meets).
SECOND_ORDER = {
    "linear_gelu": (lambda x, w, b: P.linear_gelu(x, w, b, "tanh", True)[0], "linear_gelu_backward"),
    "linear_swiglu": (lambda x, w, b: P.linear_swiglu(x, torch.cat([w, w.flip(0)]), torch.cat([b, b]), True)[0],
                      "linear_swiglu_backward"),
    "bias_gelu": (lambda x, w, b: P.bias_gelu(x, b.repeat(2)[:5], "tanh")[0], "bias_gelu_backward"),
    "rms_norm": (lambda x, w, b: P.rms_norm(x, b.repeat(2)[:5], 1e-6)[0], "rms_norm_backward"),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_second_order_gradient_raises_naming_the_backward_op(case, device):
    fn, backward_op = SECOND_ORDER[case]
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(device).requires_grad_()
               for s in ((3, 5), (4, 5), (4,)))
    first = torch.autograd.grad(fn(x, w, b).square().sum(), x)[0]
    # create_graph=True still gives the same first-order gradient...
    gx = torch.autograd.grad(fn(x, w, b).square().sum(), x, create_graph=True)[0]
    assert torch.equal(gx, first) and gx.requires_grad
    # ...and differentiating it again raises instead of returning None with a warning.
    with pytest.raises(RuntimeError, match=f"parallel_layers::{backward_op} has no derivative"):
        torch.autograd.grad(gx.sum(), x)


@pytest.mark.parametrize("device", devices())
def test_ops_without_a_derivative_record_no_graph_unless_asked(device):
    """Called on tensors that require grad, linear_forward (whose gradients the tensor-parallel
    layers compute) raises on backward; under no_grad, or on tensors that do not require grad,
    nothing is recorded, and the values are the op's."""
    x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, device=device)
    y = P.linear_forward(x, w, None)
    torch.testing.assert_close(y, x.detach() @ w.t())
    with pytest.raises(RuntimeError, match="parallel_layers::linear_forward has no derivative"):
        y.sum().backward()
    with torch.no_grad():
        assert not P.linear_forward(x, w, None).requires_grad
    dz = torch.randn(3, 4, dtype=torch.float64, device=device)
    assert not P.linear_input_grad(dz, w).requires_grad
    torch.testing.assert_close(P.linear_weight_grad(dz, x.detach()), dz.t() @ x.detach())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # torch's forward_ad import
@pytest.mark.parametrize("device", devices())
def test_forward_mode_ad_raises_instead_of_a_zero_tangent(device):
    """Run below autograd, an op without a derivative would give a dual tensor no tangent."""
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(3, 5, dtype=torch.float64, device=device)
    w = torch.randn(4, 5, dtype=torch.float64, device=device)
    dz = torch.randn(3, 4, dtype=torch.float64, device=device)
    calls = {"linear_forward": lambda d: P.linear_forward(d, w, None),
             "linear_input_grad": lambda d: P.linear_input_grad(dz, d),
             "linear_weight_grad": lambda d: P.linear_weight_grad(dz, d)}
    for name, call in calls.items():
        primal = w if name == "linear_input_grad" else x
        with fwAD.dual_level():
            dual = fwAD.make_dual(primal, torch.ones_like(primal))
            with pytest.raises(NotImplementedError, match=f"parallel_layers::{name} has no forward-mode derivative"):
                call(dual)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # torch's forward_ad import
@pytest.mark.parametrize("case", list(CASES))
def test_differentiable_ops_reject_dual_tensors_even_without_grad_mode(case):
    """Note [no autograd node without a graph to record]: a dual input still takes the C++
    Function, which has no jvp and raises; below autograd it would get a silent zero tangent."""
    import torch.autograd.forward_ad as fwAD
    g = torch.Generator().manual_seed(3)
    fn, names = CASES[case]
    inputs = [torch.randn(*SHAPES[n], generator=g, dtype=torch.float64) for n in names.split()]
    with torch.no_grad(), fwAD.dual_level():
        inputs[0] = fwAD.make_dual(inputs[0], torch.ones_like(inputs[0]))
        with pytest.raises(RuntimeError, match="jvp is not implemented"):
            fn(*inputs)


def test_functorch_transforms_run_ops_whose_inputs_do_not_depend_on_the_transformed_argument():
    """The no-graph path skips Function::apply and with it functorch's refusal of C++ Functions:
    an op whose inputs do not depend on the transformed argument is a constant to torch.func and
    now runs (it raised before); one whose inputs do depend still raises."""
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*SHAPES[n], generator=g, dtype=torch.float64) for n in ("x", "w", "b"))
    y = P.linear_gelu(x, w, b, "tanh", False)[0]
    s = torch.tensor(1.5, dtype=torch.float64)
    grad_s = torch.func.grad(lambda s: (s * P.linear_gelu(x, w, b, "tanh", False)[0]).sum())(s)
    torch.testing.assert_close(grad_s, y.sum(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(lambda s: P.linear_gelu(s * x, w, b, "tanh", False)[0].sum())(s)


def test_bias_gradients_do_not_depend_on_the_thread_count():
    """Each backward that sums the bias gradient over rows sums per-chunk partials, and the chunks
    are fixed by the shape (Note in docs/kernels.md, GeLU rule step 2): a run's bits do not change
    with OMP_NUM_THREADS / torch.set_num_threads. 16384 rows make enough chunks that a chunking
    by thread count (as the CPU kernels had) gave a different dbias at every count."""
    g = torch.Generator().manual_seed(3)
    rows, k, n = 16384, 16, 64
    x, w = torch.randn(rows, k, generator=g), torch.randn(2 * n, k, generator=g)
    z, z2 = torch.randn(rows, n, generator=g), torch.randn(rows, 2 * n, generator=g)
    dy = torch.randn(rows, n, generator=g)
    backwards = {
        "bias_gelu_backward": lambda: P.bias_gelu_backward(dy, z, "tanh")[1],
        "swiglu_backward": lambda: P.swiglu_backward(dy, z2, True)[1],
        "linear_gelu_backward": lambda: P.linear_gelu_backward(dy, x, w[:n], z, "tanh", [True, True, True])[2],
        "linear_swiglu_backward": lambda: P.linear_swiglu_backward(dy, x, w, z2, [True, True, True])[2],
    }
    threads = torch.get_num_threads()
    try:
        for name, backward in backwards.items():
            per_count = []
            for t in (1, 2, 3, 4):
                torch.set_num_threads(t)
                per_count.append(backward())
            for t, dbias in zip((2, 3, 4), per_count[1:]):
                assert torch.equal(dbias, per_count[0]), (
                    f"{name}: dbias at {t} threads differs from 1 thread's by "
                    f"{(dbias - per_count[0]).abs().max().item():.3g}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", devices())
def test_an_empty_feature_dimension_through_both_outputs(device):
    """n = 0 features with the pre-activation output used too: the bias gradient is the sum of dz
    over rows, which reshape([-1, 0]) could not make ("cannot reshape tensor of 0 elements")."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    c = torch.randn(0, device=device, requires_grad=True)
    y, z = P.bias_gelu(x, c, "none")
    (y.sum() + z.sum()).backward()
    assert x.grad.shape == (3, 0) and c.grad.shape == (0,)
    v = torch.randn(0, device=device, requires_grad=True)  # 1-D
    y, z = P.bias_gelu(v, c, "tanh")
    (y.sum() + 2 * z.sum()).backward()
    assert v.grad.shape == (0,)
    x = torch.randn(3, 4, device=device, requires_grad=True)
    for w, op in ((torch.randn(0, 4, device=device, requires_grad=True), lambda w, b: P.linear_gelu(x, w, b, "tanh", True)),
                  (torch.randn(0, 4, device=device, requires_grad=True), lambda w, b: P.linear_swiglu(x, w, b, True))):
        b = torch.randn(0, device=device, requires_grad=True)
        y, z = op(w, b)
        (y.sum() + z.sum()).backward()
        assert w.grad.shape == w.shape and b.grad.shape == (0,)
        assert torch.equal(x.grad, torch.zeros_like(x))
    # k = 0 input features (helper-43: linear_grads reshaped x to [-1, 0]): dz flows to the bias only
    x = torch.randn(3, 0, device=device, requires_grad=True)
    for rows, op in ((4, lambda w, b: P.linear_gelu(x, w, b, "tanh", True)), (8, lambda w, b: P.linear_swiglu(x, w, b, True))):
        w = torch.randn(rows, 0, device=device, requires_grad=True)
        b = torch.randn(rows, device=device, requires_grad=True)
        y, z = op(w, b)
        (y.sum() + z.sum()).backward()
        assert x.grad.shape == (3, 0) and w.grad.shape == (rows, 0) and b.grad.shape == (rows,)
        assert bool(b.grad.abs().sum() > 0)
