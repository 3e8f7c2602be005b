"""The state dict a checkpoint holds, built from a model's placement (parallel_layers.placement).

    {"model":     {<unparallelized state_dict key>: tensor, ...},
     "optimizer": {"state.<key>.<name>": tensor or scalar,          # exp_avg, exp_avg_sq, step
                   "param_groups.<key>.<setting>": value, ...},     # lr, betas, ... per parameter
     "rng":       {"rank<r>": {"cpu": tensor, "cuda": tensor}}}

This is torchtitan's namespace, and the optimizer part is the flattened form of
torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(flatten_optimizer_state_dict
=True), which torchtitan uses: settings are recorded per parameter, so pipeline stages, each
with its own optimizer, never collide, and any grouping of parameters maps back by name. An
optimizer state shaped like its parameter is cut exactly like it (the same pieces); anything
else of a parameter's state (Adam's 0-d `step`, Python numbers) is stored whole.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_layers.checkpoint._present import present_placement
from parallel_layers.placement import ModelPlacement, TensorPlacement
from parallel_layers import random_states

MODEL, OPTIMIZER, RNG = "model", "optimizer", "rng"


def model_state(described: ModelPlacement, copies: dict[int, Tensor] | None = None) -> dict[str, Tensor]:
    """Every state_dict entry this rank holds a piece of, presented to DCP; `copies` maps
    id(local) to a staged copy to present instead (asynchronous save)."""
    copies = copies or {}
    return {name: present_placement(tp, copies.get(id(tp.local))) for name, tp in described.tensors.items()
            if tp.pieces}


def _placement_of(by_local: dict[int, TensorPlacement], p: Tensor) -> TensorPlacement:
    if id(p) not in by_local:
        raise ValueError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not a parameter of the model "
                         "(under ZeRO pass zero.optimizer, whose parameters are ZeRO's shards)")
    return by_local[id(p)]


def _params(optimizer: torch.optim.Optimizer):
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield gi, p


def optimizer_state(optimizer: torch.optim.Optimizer, described: ModelPlacement,
                    copies: dict[int, Tensor] | None = None) -> dict:
    """The optimizer's state and settings by parameter name (the module doc's form)."""
    by_local, copies, out = described.by_local(), copies or {}, {}
    for gi, p in _params(optimizer):
        tp = _placement_of(by_local, p)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0:
                if value.shape != p.shape:
                    raise NotImplementedError(
                        f"optimizer state {key!r} of {tp.name} has shape {tuple(value.shape)}, neither a scalar nor "
                        f"the shape of the parameter it belongs to {tuple(p.shape)}; it cannot be resharded")
                if tp.pieces:
                    out[f"state.{tp.name}.{key}"] = present_placement(tp, copies.get(id(value), value))
            elif isinstance(value, Tensor):
                out[f"state.{tp.name}.{key}"] = copies.get(id(value), value)
            elif value is None or isinstance(value, (bool, int, float, str)):
                out[f"state.{tp.name}.{key}"] = value
            else:
                raise TypeError(f"optimizer state {key!r} of {tp.name} is a {type(value).__name__}; only tensors "
                                "and numbers can be checkpointed")
        for key, value in optimizer.param_groups[gi].items():
            if key != "params":  # a tensor setting (a Tensor lr) is copied: a scheduler updates it in place
                out[f"param_groups.{tp.name}.{key}"] = value.detach().cpu().clone() if isinstance(value, Tensor) \
                    else value
    return out


def _saved_optimizer_keys(metadata: Metadata) -> dict[str, dict[str, dict]]:
    """name -> {"state": {key: storage metadata}, "param_groups": {setting: ...}} in a checkpoint."""
    found: dict[str, dict[str, dict]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        for part in ("state", "param_groups"):
            head = f"{OPTIMIZER}.{part}."
            if fqn.startswith(head) and "." in fqn[len(head):]:
                name, key = fqn[len(head):].rsplit(".", 1)
                found.setdefault(name, {"state": {}, "param_groups": {}})[part][key] = md
    return found


def has_optimizer(metadata: Metadata) -> bool:
    return any(k.startswith(f"{OPTIMIZER}.") for k in metadata.state_dict_metadata)


class OptimizerLoad:
    """The buffers a load fills for an optimizer (`template`), then `apply` loads them into it."""

    def __init__(self, optimizer: torch.optim.Optimizer, described: ModelPlacement, metadata: Metadata):
        self.optimizer, self.template = optimizer, {}
        saved = _saved_optimizer_keys(metadata)
        by_local = described.by_local()
        self._entries = []  # (group index, param, name, {state key: template key})
        for gi, p in _params(optimizer):
            tp = _placement_of(by_local, p)
            # a tied weight's state may be under another of its keys: a checkpoint written without a
            # pipeline (ours, or torch's get_optimizer_state_dict) holds it under the first only,
            # where a pipeline's last stage steps a copy named after the head
            name = next((n for n in (tp.name, *tp.aliases) if n in saved), tp.name)
            keys = saved.get(name, {"state": {}, "param_groups": {}})
            state_keys = {}
            for key, md in keys["state"].items():
                tkey = f"state.{name}.{key}"
                if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
                    if tuple(md.size) != tuple(tp.shape):
                        raise ValueError(f"optimizer state {key!r} of {tp.name}: the checkpoint holds "
                                         f"{tuple(md.size)}, the parameter is {tuple(tp.shape)}")
                    buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if tp.pieces:  # a rank holding only padding reads nothing
                        self.template[tkey] = present_placement(tp, buf)
                    state_keys[key] = (tkey, buf)
                elif isinstance(md, TensorStorageMetadata):
                    self.template[tkey] = torch.zeros((), dtype=md.properties.dtype)
                    state_keys[key] = (tkey, None)
                else:
                    self.template[tkey] = None  # a pickled Python value, replaced by dcp.load
                    state_keys[key] = (tkey, None)
            for setting, md in keys["param_groups"].items():  # a tensor (a Tensor lr) is read as one
                self.template[f"param_groups.{name}.{setting}"] = (
                    torch.zeros(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
                    else None)
            self._entries.append((gi, name, state_keys, list(keys["param_groups"])))

    def apply(self, loaded: dict) -> None:
        """Load what dcp.load put into `loaded` (the template, filled) into the optimizer."""
        state, settings = {}, {}
        for index, (gi, name, state_keys, group_keys) in enumerate(self._entries):
            entry = {key: buf if buf is not None else loaded[tkey] for key, (tkey, buf) in state_keys.items()}
            if entry:
                state[index] = entry
            if group_keys:
                values = {k: loaded[f"param_groups.{name}.{k}"] for k in group_keys}
                first = settings.setdefault(gi, (name, values))
                if first[1] != values:
                    raise ValueError(f"the parameters {first[0]} and {name} share an optimizer param group here but "
                                     f"were saved with different settings ({first[1]} vs {values}); build the "
                                     "optimizer with the grouping it was saved with")
        groups = []
        for gi, cur in enumerate(self.optimizer.state_dict()["param_groups"]):
            hyper = dict(cur)
            for k, v in settings.get(gi, (None, {}))[1].items():
                if k != "params":
                    hyper[k] = _as_current(cur.get(k), v)
            hyper["params"] = cur["params"]
            groups.append(hyper)
        try:
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            # another optimizer's state (SGD's momentum_buffer into AdamW failed "KeyError: 'step'")
            held = sorted({key for entry in state.values() for key in entry})
            raise ValueError(f"checkpoint load: {type(self.optimizer).__name__} could not take the checkpoint's "
                             f"optimizer state (per parameter: {held}): {type(e).__name__}: {e}. Was it saved with "
                             "another optimizer? Build the one it was saved with, or load the model alone "
                             "(optimizer=None) and start the optimizer afresh") from e


def _as_current(current, saved):
    """A saved optimizer setting in the form the optimizer holds it now: a tuple (betas), a
    tensor on its device (a Tensor lr, as compiled optimizers take), a number."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, Tensor):
        return torch.as_tensor(saved, dtype=current.dtype).to(current.device)
    if isinstance(saved, Tensor) and saved.dim() == 0 and isinstance(current, (int, float)):
        return saved.item()
    return saved


def rng_state(rank: int) -> dict[str, dict[str, Tensor]]:
    """This rank's random states: the default generators', and the library's own streams
    (parallel_layers/random_states.py; the TP regions': "tp_region_cpu" / "tp_region_cuda")."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    state.update(random_states.state_dict())  # the library's own streams (parallel_layers/random_states.py)
    return {f"rank{rank}": state}


def rng_template(rank: int, metadata: Metadata) -> dict[str, dict[str, Tensor]]:
    """Buffers for this rank's saved RNG states, if the checkpoint has them."""
    out, prefix = {}, f"{RNG}.rank{rank}."
    for name, md in metadata.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            out[name.removeprefix(prefix)] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return {f"rank{rank}": out} if out else {}


def set_rng(loaded: dict) -> None:
    for state in loaded.values():
        if "cpu" in state:
            torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        random_states.load_state_dict({k: v for k, v in state.items() if k not in ("cpu", "cuda")})
