"""What a rank holds of the model: each state_dict entry's logical name, layout and storage.

Logical names are the unparallelized model's state_dict keys. A wrapped model (ZeRO,
DataParallel, DistributedDataParallel) is looked through to its `.module`; under ZeRO a
parameter's data is its float32 master shard (`group.shards`), not the module's
parameter (freed under stage 3, possibly low precision under param_dtype). Tied weights
(one tensor under two keys) are stored once; the second key is an alias.

Note [pipeline names]: pipeline stages contribute disjoint logical names. A PipelineStages
module names its layers by chunk ("chunks.<c>.<j>.rest"); they are renamed to the index in
the layer list it was cut from ("<i>.rest"), and `prefix` (e.g. "layers.") makes that the
unparallelized model's key. A weight tied across stages (embedding and LM head) is held by
two ranks under two keys, and so stored twice; a single-stage model stores it once, with
an alias, and either form loads into the other.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch import Tensor

from parallel_layers.checkpoint._layout import TensorLayout, layout_of
from parallel_layers.data_parallel import DataParallel
from parallel_layers.pipeline.stages import PipelineStages
from parallel_layers.zero.api import ZeRO


@dataclasses.dataclass(frozen=True)
class Tracked:
    data: Tensor  # where this rank's values are read and written: the tensor, or its ZeRO shard
    layout: TensorLayout


@dataclasses.dataclass
class ModelView:
    module: nn.Module
    zero: ZeRO | None
    tensors: dict[str, Tracked]  # logical name -> this rank's part
    aliases: dict[str, str]  # tied key -> the key stored
    keys: list[str]  # state_dict order
    opt_params: dict[int, tuple[str, TensorLayout]]  # id(tensor an optimizer steps) -> (name, layout)


def unwrap(model: nn.Module) -> tuple[nn.Module, ZeRO | None]:
    if isinstance(model, ZeRO):
        return model.module, model
    from torch.nn.parallel import DistributedDataParallel
    while isinstance(model, (DataParallel, DistributedDataParallel)):
        model = model.module
    return model, None


def _padded_rows(module: nn.Module) -> dict[str, int]:
    """state_dict key -> real rows, for weights whose dim 0 is padded (vocab-parallel embeddings:
    duck-typed on `num_embeddings` < `padded_num_embeddings`)."""
    rows = {}
    for prefix, m in module.named_modules():
        real, padded = getattr(m, "num_embeddings", None), getattr(m, "padded_num_embeddings", None)
        if isinstance(real, int) and isinstance(padded, int) and padded != real:
            rows[f"{prefix}.weight" if prefix else "weight"] = real
    return rows


def _logical_names(module: nn.Module, prefix: str):
    """state_dict key -> logical name (Note [pipeline names])."""
    if not isinstance(module, PipelineStages):
        return lambda key: prefix + key

    def rename(key: str) -> str:
        _, chunk, j, rest = key.split(".", 3)
        return f"{prefix}{module.bounds[module.stage_ids[int(chunk)]][0] + int(j)}.{rest}"
    return rename


def describe(model: nn.Module, prefix: str = "") -> ModelView:
    module, zero = unwrap(model)
    logical_name = _logical_names(module, prefix)
    rows = {logical_name(k): v for k, v in _padded_rows(module).items()}
    in_zero = {}  # id(param) -> (world, rank, shard)
    if zero is not None:
        for g in zero.groups:
            for i, p in enumerate(g.params):
                in_zero[id(p)] = (g.world, g.rank, g.shards[i])
    view = ModelView(module, zero, {}, {}, [], {})
    seen: dict[int, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = logical_name(key)
        if not isinstance(t, Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__}; only tensors can be checkpointed "
                            "(move extra state into save(..., extra=...))")
        view.keys.append(name)
        if id(t) in seen:
            view.aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        spec = getattr(t, "tp_shard", None)
        full = tuple(spec.full_shape) if spec is not None else tuple(t.shape)
        logical = (rows[name],) + full[1:] if name in rows else full
        if id(t) in in_zero:
            world, rank, shard = in_zero[id(t)]
            layout = layout_of(name, tuple(t.shape), spec, logical, (world, rank))
            view.tensors[name] = Tracked(shard, layout)
            view.opt_params[id(shard)] = (name, layout)
        else:
            layout = layout_of(name, tuple(t.shape), spec, logical)
            view.tensors[name] = Tracked(t, layout)
            view.opt_params[id(t)] = (name, layout)
    return view
