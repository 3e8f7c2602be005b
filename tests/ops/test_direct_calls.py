"""Note [direct op calls] (csrc/registration.cpp, parallel_layers/ops/_call.py): the Python
wrappers call each op's typed dispatcher entry, _C._call_<op>, where no Python machinery needs to
see the call. That entry must give the op's results bit for bit and keep every dispatcher-level
observer (autograd, dispatch modes); __torch_function__ and Dynamo must still see torch.ops."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import parallel_layers.ops as ops
from parallel_layers import _C
from tests.ops.numerics import devices

P = torch.ops.parallel_layers


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device)
    x, w, b, w2, b2, n, dz = t(3, 5), t(4, 5), t(4), t(8, 5), t(8), t(5), t(3, 4)
    rstd = P.rms_norm(x, n, 1e-6)[1]
    return {  # op: its positional arguments
        "bias_gelu": (x, n, "tanh"), "bias_gelu_backward": (x, x.cos(), "none"),
        "linear_gelu": (x, w, b, "tanh", True), "linear_swiglu": (x, w2, b2, True),
        "swiglu_backward": (dz, t(3, 8), True), "linear_weight_grad": (dz, x), "linear_input_grad": (dz, w),
        "linear_forward": (x, w, None), "linear_autocast_inputs": (x, w, b), "transpose_2d": (w,),
        "rms_norm": (x, n, 1e-6), "rms_norm_add": (x, x.sin(), n, 1e-6),
        "rms_norm_backward": (x.cos(), x, n, rstd, x.sin()),
    }


def _flat(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


class _Seen(TorchDispatchMode):
    """Records the ops the dispatcher hands to Python dispatch modes, with their argument shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", devices())
def test_the_direct_entry_of_every_op_gives_the_boxed_calls_bits_and_mode_events(device):
    for name, args in _inputs(device).items():
        with _Seen() as seen_direct:
            direct = getattr(_C, f"_call_{name}")(*args)
        with _Seen() as seen_boxed:
            boxed = getattr(P, name).default(*args)
        assert seen_direct.ops == seen_boxed.ops, name
        assert len(_flat(direct)) == len(_flat(boxed)), name
        for a, b in zip(_flat(direct), _flat(boxed)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_op_call_takes_the_direct_entry_only_where_python_need_not_see_the_call(monkeypatch):
    """The routing itself: the direct entry in eager code; torch.ops under a TorchFunctionMode,
    under Dynamo, and for arguments of a Python type the direct entry rejects."""
    import parallel_layers.ops._call as call_module
    calls = []

    def spy(*args):
        calls.append(args)
        return _C._call_rms_norm(*args)
    monkeypatch.setattr(call_module, "_C", type("FakeC", (), {"_call_rms_norm": staticmethod(spy)}))
    rms_norm = call_module.op_call("rms_norm")
    x, w = torch.randn(3, 5), torch.randn(5)
    expected = P.rms_norm(x, w, 1e-6)[0]
    assert torch.equal(rms_norm(x, w, 1e-6)[0], expected) and len(calls) == 1
    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Passthrough():
        rms_norm(x, w, 1e-6)
    assert len(calls) == 1
    torch.compile(lambda a: rms_norm(a, w, 1e-6)[0], fullgraph=True, backend="eager")(x)
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="Expected a value of type 'float' for argument 'eps'"):
        rms_norm(x, w, "a")  # torch's error, not pybind11's
    monkeypatch.setattr(call_module, "_C", type("OlderC", (), {}))
    with pytest.raises(ImportError, match="_call_rms_norm.*Rebuild"):
        call_module.op_call("rms_norm")


def test_every_op_of_a_python_wrapper_has_a_direct_entry():
    """Every op the wrappers call through op_call is bound; the shard copies (tensor lists) are not."""
    bound = {n.removeprefix("_call_") for n in dir(_C) if n.startswith("_call_")}
    assert bound == set(_inputs("cpu"))
    assert not any(n.startswith("_call_") and "copy" in n for n in dir(_C))


def test_dispatch_modes_and_autograd_see_the_direct_call():
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(5)
    with _Seen() as seen:
        y = ops.rms_norm(x, w, 1e-6)
    assert seen.ops == [("parallel_layers.rms_norm.default", [(3, 5), (5,)])]
    assert y.grad_fn is not None  # the Autograd kernel ran
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_torch_function_modes_and_dynamo_get_torch_ops():
    class Funcs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(3, 5), torch.randn(5)
    with Funcs() as mode:
        y = ops.rms_norm(x, w, 1e-6)
    assert P.rms_norm in mode.funcs  # not hidden behind the direct entry; the packet, as before
    compiled = torch.compile(lambda a: ops.rms_norm(a, w, 1e-6), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), y, rtol=0, atol=0)
