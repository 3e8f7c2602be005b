"""ZeRO-style sharded data parallelism (stages 1, 2, 3) on the shard copy kernels.

Split by responsibility, as PyTorch FSDP2's `_fully_shard/` is:
  _param.py   ShardedParam, the unit: one parameter, its float32 master shard, freeing and
              refilling its full storage, what the collectives read and write for it
  _group.py   ParamGroup: the ShardedParams of one wrapped module, one all-gather and one
              reduce-scatter for all of them, the CUDA side stream
  _hooks.py   ZeROHooks: stage 2/3 hooks, backward state, prefetch order, when each group
              is reduced (Note [agreed reduction order])
  _state.py   the placement description, full and sharded state dicts, memory accounting
  api.py      ZeRO, the public wrapper that builds the groups and ties the rest together
"""

from parallel_layers.zero._param import ShardedParam, UnshardHandle
from parallel_layers.zero.api import ZeRO

__all__ = ["ShardedParam", "UnshardHandle", "ZeRO"]
