"""How the Python wrappers call the ops: `op_call(name)` (Note [direct op calls], csrc/registration.cpp).

The returned callable takes the positional arguments of `torch.ops.parallel_layers.<name>` and
runs the same dispatcher call. In eager code it goes through `_C._call_<name>`, the op's typed
entry, which skips the boxed call's Python argument conversion (1.5-2.2 us of a small op's call
on CPU). It goes through `torch.ops.parallel_layers.<name>.default` instead while Dynamo traces
(torch.compile, torch.export) or while any argument or mode has a `__torch_function__` to run
(FX proxies, tensor subclasses that override it, TorchFunctionModes): those see only calls made
from Python.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import has_torch_function

from parallel_layers import _C


def op_call(name: str) -> Callable:
    """`torch.ops.parallel_layers.<name>.default`'s call, direct where nothing in Python must see it."""
    overload = getattr(torch.ops.parallel_layers, name).default
    direct = getattr(_C, f"_call_{name}")
    is_compiling = torch.compiler.is_compiling

    def call(*args):
        if is_compiling() or has_torch_function(args):
            return overload(*args)
        return direct(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch.ops.parallel_layers.{name}, called as op_call (parallel_layers/ops/_call.py) calls it."
    return call
