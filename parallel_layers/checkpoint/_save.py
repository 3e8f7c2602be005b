"""save(): every rank writes the pieces it owns; rank 0 commits (Note [atomic save]).

Collectives, on the group (default: the world), in order: all-gather of the piece tables
(with any local error), broadcast of the partial directory, all-gather of the write
statuses, broadcast of the commit result. Each is also where errors meet (Note [errors on
every rank]).

Note [replicated pieces]: a piece described identically by several ranks (the same box and
range of the same logical tensor: DP replicas, TP-replicated LayerNorms, ...) is written
once, by the lowest rank holding it. Every holder sends a CRC-32 of its copy, so replicas
that drifted apart are reported (a warning; the lowest rank's copy is kept), and load
checks each piece it reads against the same CRC.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
import zlib

import torch
from torch import Tensor

from parallel_layers.checkpoint import _io
from parallel_layers.checkpoint._dist import all_gather, broadcast, describe_error, raise_if_any, rank_world
from parallel_layers.checkpoint._layout import Piece
from parallel_layers.checkpoint._optim import flatten, merge
from parallel_layers.checkpoint._state import describe


def crc32(t: Tensor) -> int:
    t = t.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy())


def _check_extra(extra) -> dict:
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'step': 100, 'samples_seen': 6400}}), got "
                        f"{type(extra).__name__}")
    try:
        return json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold only JSON values (numbers, strings, lists, dicts): {e}") from e


def rng_state() -> dict[str, Tensor]:
    state = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng/cuda"] = torch.cuda.get_rng_state()
    return state


def layout_signature(view, world: int) -> str:
    """A digest of which model pieces this rank holds, and of the world size: equal on every
    rank at save and at load <=> the same layout (then the RNG state is restored)."""
    desc = [(name, [slot.piece.to_json() for slot in tr.layout.slots]) for name, tr in view.tensors.items()]
    return hashlib.sha1(json.dumps([world, desc]).encode()).hexdigest()


def _local_table(model, optimizer, world: int, prefix: str):
    """This rank's piece table (JSON, with a CRC-32 per piece) and the pieces' data, by key."""
    view = describe(model, prefix)
    entries = [(f"model/{name}", tr.layout, tr.data) for name, tr in view.tensors.items()]
    record = None
    if optimizer is not None:
        opt_entries, record = flatten(optimizer, view.opt_params)
        entries += opt_entries
    table = {"tensors": {}, "keys": view.keys, "aliases": view.aliases, "optimizer": record,
             "signature": layout_signature(view, world)}
    data = {}
    for logical, layout, local in entries:
        pieces = []
        for i, slot in enumerate(layout.slots):
            key = f"{logical}#{i}"
            data[key] = slot.view(local).detach()
            pieces.append({**slot.piece.to_json(), "key": key, "crc32": crc32(data[key])})
        table["tensors"][logical] = {"shape": list(layout.shape), "dtype": str(local.dtype), "pieces": pieces}
    return table, data


def _merge(tables: list[dict], step: int, extra: dict, warn: bool) -> tuple[dict, list[set]]:
    """One metadata dict from every rank's table, and the piece keys each rank writes
    (Note [replicated pieces]). Deterministic: every rank computes the same."""
    tensors, owner, owned, first = {}, {}, [set() for _ in tables], {}
    for r, table in enumerate(tables):
        for logical, info in table["tensors"].items():
            merged = tensors.setdefault(logical, {"shape": info["shape"], "dtype": info["dtype"], "pieces": []})
            first.setdefault(logical, r)
            if (merged["shape"], merged["dtype"]) != (info["shape"], info["dtype"]):
                raise ValueError(f"ranks disagree on {logical}: rank {first[logical]} holds it as {merged['dtype']} "
                                 f"{merged['shape']}, rank {r} as {info['dtype']} {info['shape']}")
            for p in info["pieces"]:
                desc = (logical, json.dumps([p["offsets"], p["sizes"], p["flat"]]))
                if desc in owner:
                    if owner[desc]["crc32"] != p["crc32"] and warn:
                        warnings.warn(f"checkpoint save: ranks {owner[desc]['rank']} and {r} hold different values "
                                      f"for the same part of {logical} (replicas out of sync?); saving rank "
                                      f"{owner[desc]['rank']}'s", RuntimeWarning, stacklevel=3)
                    continue
                owner[desc] = {**p, "rank": r}
                merged["pieces"].append(owner[desc])
                owned[r].add(p["key"])
    for logical, info in tensors.items():
        covered, numel = sum(Piece.from_json(p).numel for p in info["pieces"]), math.prod(info["shape"])
        if covered != numel:
            raise ValueError(f"{logical}: the ranks' pieces cover {covered} of its {numel} elements; pieces overlap or "
                             "are missing (pipeline stages must name parameters as the unparallelized model does)")
    with_opt = [t["optimizer"] is not None for t in tables]
    if any(with_opt) and not all(with_opt):
        raise ValueError(f"an optimizer was passed on ranks {[r for r, o in enumerate(with_opt) if o]} only; pass "
                         "this rank's optimizer on every rank, or none")
    keys = list(dict.fromkeys(k for t in tables for k in t["keys"]))
    meta = {"format": _io.FORMAT, "step": step, "world_size": len(tables), "extra": extra, "keys": keys,
            "aliases": {k: v for t in tables for k, v in t["aliases"].items()}, "tensors": tensors,
            "optimizer": merge([t["optimizer"] for t in tables]) if all(with_opt) else None,
            "rng": {"signatures": [t["signature"] for t in tables]}}
    return meta, owned


def save(directory: str, step: int, model, optimizer=None, *, extra: dict | None = None, group=None,
         prefix: str = "") -> str:
    """Save `model` (and `optimizer`, RNG, `extra`) as <directory>/step_<step>; a collective.

    model: the model as trained - plain, tensor parallel, DataParallel or ZeRO (then pass
    zero.optimizer). extra: JSON values to get back from load (data position, step, epoch).
    prefix: prepended to the model's keys (Note [pipeline names] in _state.py).
    Returns the checkpoint's path once every rank's file and the metadata are durable.
    """
    rank, world = rank_world(group)
    mine = table = data = None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra = _check_extra(extra)
        table, data = _local_table(model, optimizer, world, prefix)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = e
    gathered = all_gather((describe_error(mine) if mine else None, table), group)
    raise_if_any([g[0] for g in gathered], mine, "checkpoint save")
    metadata, owned = _merge([g[1] for g in gathered], step, extra, warn=rank == 0)

    partial = err = None
    if rank == 0:
        try:
            partial = _io.start(directory, step)
        except OSError as e:
            err = describe_error(e)
    partial, err = broadcast((partial, err), group)
    if err is not None:
        raise RuntimeError(f"checkpoint save: rank 0 could not create a directory under {directory!r}: {err}")

    mine, size = None, None
    try:
        payload = {k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in data.items() if k in owned[rank]}
        payload.update(rng_state())
        size = _io.write_tensors(os.path.join(partial, _io.rank_file(rank)), payload)
    except Exception as e:  # noqa: BLE001
        mine = e
    statuses = all_gather((describe_error(mine) if mine else None, size), group)
    raise_if_any([s[0] for s in statuses], mine, "checkpoint save")

    final = err = None
    if rank == 0:
        metadata["files"] = {_io.rank_file(r): s[1] for r, s in enumerate(statuses)}
        try:
            final = _io.commit(partial, metadata)
        except OSError as e:
            err = describe_error(e)
    final, err = broadcast((final, err), group)
    if err is not None:
        raise RuntimeError(f"checkpoint save: rank 0 could not commit {partial!r}: {err}")
    return final
