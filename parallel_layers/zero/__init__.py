"""ZeRO-style sharded data parallelism (stages 1, 2, 3) on the shard copy kernels."""

from parallel_layers.zero._param import ShardedParam, UnshardHandle
from parallel_layers.zero.api import ZeRO

__all__ = ["ShardedParam", "UnshardHandle", "ZeRO"]
