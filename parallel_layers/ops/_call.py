"""How the Python wrappers call the ops: `op_call(name)` (Note [direct op calls], csrc/registration.cpp).

The returned callable takes the positional arguments of `torch.ops.parallel_layers.<name>` and
runs the same dispatcher call. In eager code it goes through `_C._call_<name>`, the op's typed
entry, which skips the boxed call's Python argument conversion (1.5-2.2 us of a small op's call
on CPU). It calls `torch.ops.parallel_layers.<name>` instead, as the wrappers did before, in
three cases:
- while Dynamo traces (torch.compile, torch.export);
- while any argument or mode has a `__torch_function__` to run: FX proxies, tensor subclasses
  that override it, TorchFunctionModes. Those see only calls made from Python. This includes the
  mode that `torch.set_default_device` and `with torch.device(...)` install, so under them every
  call takes the boxed path;
- when the direct entry rejects the arguments' Python types. The boxed call then raises torch's
  own error for them ("Expected a value of type ... for argument ..."), not pybind11's.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import has_torch_function

from parallel_layers import _C, _extension


def op_call(name: str) -> Callable:
    """`torch.ops.parallel_layers.<name>`'s call, direct where nothing in Python must see it."""
    packet = getattr(torch.ops.parallel_layers, name)
    direct = getattr(_C, f"_call_{name}", None)
    if direct is None:  # an extension built from an older source tree, for the same torch
        raise ImportError(f"parallel_layers._C has no _call_{name}: it was built from older sources than this "
                          f"package's Python files. " + _extension._REBUILD_HINT.format(installed=torch.__version__))
    is_compiling = torch.compiler.is_compiling

    def call(*args):
        if is_compiling() or has_torch_function(args):
            return packet(*args)
        try:
            return direct(*args)
        except TypeError:
            # pybind11 rejected an argument's Python type: torch.ops raises torch's own error for it.
            # (The ops raise no TypeError themselves; one would be raised again there.)
            return packet(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.parallel_layers.{name}, called as op_call (parallel_layers/ops/_call.py) calls it."
    return call
