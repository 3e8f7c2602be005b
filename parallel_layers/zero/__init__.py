"""ZeRO-style sharded data parallelism (stages 1, 2, 3) on the shard copy kernels."""

from parallel_layers.zero.api import ZeRO
from parallel_layers.zero.sharded_param import ShardedParam, UnshardHandle

__all__ = ["ShardedParam", "UnshardHandle", "ZeRO"]
