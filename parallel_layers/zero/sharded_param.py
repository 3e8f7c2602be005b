"""`ShardedParam`: one parameter, sharded over a group, gathered on demand.

    sp = ShardedParam(layer.weight, group)     # the full tensor's storage is freed now
    handle = sp.unshard(async_op=True)         # all-gather in flight
    ...                                        # other work
    handle.wait()                              # layer.weight holds the full values again
    loss.backward(); sp.reduce_grad()          # averaged gradient lands in sp.shard.grad
    sp.reshard()                               # frees the full storage again

The building block of ZeRO (a parameter group of one; see _group.py, Note [ZeRO param
group]). Sharding is of the flattened parameter: element-wise, padded to a multiple of the
world size, so every rank holds exactly ceil(numel / W) elements whatever the shape (a
[7, 15] weight over 4 ranks is 27 elements each, where a dim-0 split would give 2 rows to
three ranks and 1 real row plus padding to the last). The shard is a float32 master copy,
the one an optimizer steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers.zero._group import ParamGroup, check_dtypes


class UnshardHandle:
    """What `ShardedParam.unshard(async_op=True)` returns: `wait()` completes the gather."""

    def __init__(self, group: ParamGroup):
        self._group = group

    def wait(self) -> None:
        self._group.unshard()


class ShardedParam:
    def __init__(self, param: nn.Parameter, group: dist.ProcessGroup | None = None, *,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32):
        check_dtypes(param_dtype, reduce_dtype)
        if not dist.is_initialized():
            raise RuntimeError("ShardedParam needs torch.distributed to be initialised")
        self._group = ParamGroup("param", [param], group, param_dtype, reduce_dtype, alias_full=False)
        if param_dtype is not None:
            param.data = param.data.to(param_dtype)
        self.full = param
        self.shard = self._group.shards[0]  # [ceil(numel / W)] float32, this rank's
        self._group.reshard()

    @property
    def is_unsharded(self) -> bool:
        return self._group.is_unsharded

    def unshard(self, async_op: bool = False) -> UnshardHandle:
        """Gather the full parameter; with async_op, return before the gather completes."""
        self._group.start_unshard()
        handle = UnshardHandle(self._group)
        if not async_op:
            handle.wait()
        return handle

    def reshard(self) -> None:
        """Free the full parameter's storage (the shard stays)."""
        self._group.reshard()

    def reduce_grad(self) -> None:
        """Average `full.grad` over the group into `shard.grad` (accumulating) and free it."""
        self._group.reduce_grads(free_full_grads=True)
