"""Optimizer state by logical parameter name, so it survives a change of layout.

A state tensor shaped like the tensor the optimizer steps (Adam's exp_avg, exp_avg_sq; under
ZeRO the flat shard) is cut exactly like that parameter and stored as the logical tensor
"optim/<name>/<key>". Everything else of a parameter's state - 0-d tensors (Adam's step) and
Python numbers - is JSON ("scalars", with the tensor's dtype so it is rebuilt as one). Param
group hyperparameters (lr, betas, ...) are JSON too, recorded per parameter name so that
pipeline stages with their own optimizers, or any grouping, map back by name.
"""

from __future__ import annotations

import json
from typing import Callable

import torch
from torch import Tensor

from parallel_layers.checkpoint._layout import TensorLayout


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def _name_of(opt_params: dict[int, tuple[str, TensorLayout]], p: Tensor) -> tuple[str, TensorLayout]:
    if id(p) not in opt_params:
        raise ValueError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not a parameter of the model "
                         "(under ZeRO pass zero.optimizer, whose parameters are ZeRO's shards)")
    return opt_params[id(p)]


def _hyper(group: dict) -> dict:
    hyper = {k: v for k, v in group.items() if k != "params"}
    try:
        json.dumps(hyper)
    except TypeError as e:
        raise TypeError(f"optimizer hyperparameters must be JSON numbers/strings/lists to be checkpointed: {e}") from e
    return hyper


def flatten(optimizer: torch.optim.Optimizer, opt_params: dict[int, tuple[str, TensorLayout]]):
    """-> ([(logical tensor name, layout, local tensor)], JSON record of the rest)."""
    tensors, record = [], {"param_groups": [], "group_of": {}, "scalars": {}, "tensors": {}}
    for group in optimizer.param_groups:
        hyper = _hyper(group)
        record["param_groups"].append(hyper)
        for p in group["params"]:
            name, layout = _name_of(opt_params, p)
            record["group_of"][name] = len(record["param_groups"]) - 1
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if value.shape != p.shape:
                        raise NotImplementedError(
                            f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither a scalar nor "
                            f"the shape of the parameter it belongs to {tuple(p.shape)}; it cannot be resharded")
                    logical = f"optim/{name}/{key}"
                    record["tensors"].setdefault(name, {})[key] = logical
                    tensors.append((logical, layout, value))
                elif isinstance(value, Tensor):
                    record["scalars"].setdefault(name, {})[key] = {"value": value.item(), "dtype": str(value.dtype)}
                elif value is None or isinstance(value, (bool, int, float, str)):
                    record["scalars"].setdefault(name, {})[key] = {"value": value, "dtype": None}
                else:
                    raise TypeError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; only tensors "
                                    "and numbers can be checkpointed")
    return tensors, record


def merge(records: list[dict]) -> dict:
    """One optimizer record from every rank's (pipeline stages add their own names)."""
    out = {"param_groups": [], "group_of": {}, "scalars": {}, "tensors": {}}
    for rec in records:
        for name, gi in rec["group_of"].items():
            hyper = rec["param_groups"][gi]
            if hyper not in out["param_groups"]:
                out["param_groups"].append(hyper)
            out["group_of"].setdefault(name, out["param_groups"].index(hyper))
        for field in ("scalars", "tensors"):
            for name, v in rec[field].items():
                out[field].setdefault(name, v)
    return out


def rebuild(optimizer: torch.optim.Optimizer, opt_params: dict[int, tuple[str, TensorLayout]], record: dict,
            fill: Callable[[str, TensorLayout, Tensor], None]) -> None:
    """Load `record` into `optimizer` at the current layout; `fill(logical, layout, out)` cuts
    this rank's part of a logical tensor into `out`."""
    state, groups, index = {}, [], 0
    current = optimizer.state_dict()["param_groups"]
    for group, cur in zip(optimizer.param_groups, current):
        saved_groups = set()
        for p in group["params"]:
            name, layout = _name_of(opt_params, p)
            if name in record["group_of"]:
                saved_groups.add(record["group_of"][name])
            entry = {}
            for key, logical in record["tensors"].get(name, {}).items():
                out = torch.zeros_like(p, memory_format=torch.contiguous_format)
                fill(logical, layout, out)
                entry[key] = out
            for key, s in record["scalars"].get(name, {}).items():
                entry[key] = torch.tensor(s["value"], dtype=parse_dtype(s["dtype"])) if s["dtype"] else s["value"]
            if entry:
                state[index] = entry
            index += 1
        if len(saved_groups) > 1:
            raise ValueError(f"the parameters of one optimizer param group were saved in {len(saved_groups)} groups "
                             "with different hyperparameters; build the optimizer with the same grouping")
        hyper = dict(cur)
        if saved_groups:
            saved = record["param_groups"][saved_groups.pop()]
            for k, v in saved.items():  # JSON turned tuples (betas) into lists
                hyper[k] = tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v
        hyper["params"] = cur["params"]
        groups.append(hyper)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
