"""load() at the current layout, whatever the layout at save; export_state_dict() for one device.

Resharding: for each logical tensor this rank needs, the full tensor is assembled from the
saved pieces (zeros where nothing was saved: vocabulary and ZeRO padding), then this rank's
pieces under the current layout are cut from it. Tensors are handled one at a time and rank
files are memory-mapped, so memory holds one full tensor beyond the model; every rank reads
the pieces of every tensor it holds a part of.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from parallel_layers.checkpoint import _io
from parallel_layers.checkpoint._dist import all_gather, describe_error, raise_if_any, rank_world
from parallel_layers.checkpoint._layout import Piece, TensorLayout, piece_of, write_piece
from parallel_layers.checkpoint._optim import parse_dtype, rebuild
from parallel_layers.checkpoint._save import crc32, layout_signature
from parallel_layers.checkpoint._state import describe


class _Reader:
    """Full logical tensors of one checkpoint, from its (memory-mapped, checked) rank files."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta, self._files = path, meta, {}

    def file(self, rank: int) -> dict[str, Tensor]:
        if rank not in self._files:
            name = _io.rank_file(rank)
            self._files[rank] = _io.read_tensors(os.path.join(self.path, name), self.meta["files"].get(name))
        return self._files[rank]

    def full(self, logical: str) -> Tensor:
        info = self.meta["tensors"][logical]
        out = torch.zeros(info["shape"], dtype=parse_dtype(info["dtype"]))
        for p in info["pieces"]:
            piece, data = Piece.from_json(p), self.file(p["rank"]).get(p["key"])
            where = f"{_io.rank_file(p['rank'])} of {self.path}"
            if data is None:
                raise ValueError(f"{where} lacks {p['key']!r}, which metadata.json lists")
            if data.numel() != piece.numel or crc32(data) != p["crc32"]:
                raise ValueError(f"{where}: {p['key']!r} does not match its size ({piece.numel}) or CRC-32 in "
                                 "metadata.json; the file is corrupt")
            write_piece(out, piece, data)
        return out


def _fill(reader: _Reader, logical: str, layout: TensorLayout, out: Tensor) -> None:
    """Cut this rank's pieces of `logical` (current layout) into `out`."""
    full = reader.full(logical)
    if tuple(full.shape) != layout.shape:
        raise ValueError(f"{logical}: shape mismatch, the checkpoint has {tuple(full.shape)}, the model {layout.shape}")
    with torch.no_grad():
        for slot in layout.slots:
            dst = slot.view(out)
            dst.copy_(piece_of(full, slot.piece).reshape(dst.shape))


def _saved_name(meta: dict, name: str) -> str:
    return "model/" + meta["aliases"].get(name, name)


def _check(meta: dict, view, optimizer) -> None:
    """This rank's tensors exist in the checkpoint with the same logical shapes."""
    missing = [n for n in view.tensors if _saved_name(meta, n) not in meta["tensors"]]
    if missing:
        raise KeyError(f"the checkpoint has no tensor for {missing[:10]}{' ...' if len(missing) > 10 else ''}; it "
                       f"holds {len(meta['keys'])} model keys, e.g. {meta['keys'][:5]}")
    saved = {n: tuple(meta["tensors"][_saved_name(meta, n)]["shape"]) for n in view.tensors}
    wrong = [f"{n}: checkpoint {saved[n]} vs model {tr.layout.shape}" for n, tr in view.tensors.items()
             if saved[n] != tr.layout.shape]
    if wrong:
        raise ValueError("shape mismatch between checkpoint and model (logical, unparallelized shapes): "
                         + "; ".join(wrong))
    if optimizer is not None and meta["optimizer"] is None:
        raise ValueError("the checkpoint was saved without optimizer state; pass optimizer=None to load the model only")


def load(path: str, model, optimizer=None, *, group=None, strict: bool = True, restore_rng: bool = True,
         prefix: str = "") -> dict:
    """Load the checkpoint at `path` (a step_<N> directory) into `model` and `optimizer` at
    the current layout; a collective. Returns the `extra` dict given to save.

    strict: every model key of the checkpoint must be held by some rank. prefix: as for
    save, prepended to the model's keys (pipeline stages). The RNG state is
    restored only at the layout it was saved at (see the package doc). On an error every
    rank raises; the model may then be partly loaded.
    """
    rank, world = rank_world(group)
    mine = meta = view = signature = None
    try:
        meta = _io.read_metadata(path)
        view = describe(model, prefix)
        _check(meta, view, optimizer)
        signature = layout_signature(view, world)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = e
    gathered = all_gather((describe_error(mine) if mine else None, view.keys if view else [], signature), group)
    raise_if_any([g[0] for g in gathered], mine, "checkpoint load")
    if strict:
        held = {k for g in gathered for k in g[1]}
        unexpected = [k for k in meta["keys"] if k not in held]
        if unexpected:
            raise KeyError(f"the checkpoint holds {unexpected[:10]}, which no rank's model has; pass strict=False to "
                           "ignore them")
    same_layout = meta["world_size"] == world and [g[2] for g in gathered] == meta["rng"]["signatures"]

    mine = None
    try:
        reader = _Reader(path, meta)
        for name, tr in view.tensors.items():
            _fill(reader, _saved_name(meta, name), tr.layout, tr.data)
        if optimizer is not None:
            rebuild(optimizer, view.opt_params, meta["optimizer"],
                    lambda logical, layout, out: _fill(reader, logical, layout, out))
        if restore_rng and same_layout:
            state = reader.file(rank)
            torch.set_rng_state(state["rng/cpu"])
            if "rng/cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state(state["rng/cuda"])
    except Exception as e:  # noqa: BLE001
        mine = e
    raise_if_any(all_gather(describe_error(mine) if mine else None, group), mine, "checkpoint load")
    if view.zero is not None:  # the shards are loaded; the full parameters follow them
        for g in view.zero.groups:
            g.drop_prefetch()
            if view.zero.stage < 3 or g is view.zero.root_group:
                g.refresh_full()
            else:
                g.reshard()
    if restore_rng and not same_layout and rank == 0:
        warnings.warn(f"checkpoint load: RNG state not restored: it was saved by {meta['world_size']} rank(s) in "
                      f"another layout than these {world} rank(s) have now; random streams (dropout, data shuffling "
                      "seeded from them) continue from their current state", RuntimeWarning, stacklevel=2)
    return meta["extra"]


def export_state_dict(path: str) -> dict[str, Tensor]:
    """The plain, full state dict of the model saved at `path`, for the unparallelized model's
    `load_state_dict(strict=True)`; one process, no torch.distributed needed. ZeRO-trained
    parameters come back as their float32 masters; tied keys share one tensor."""
    meta = _io.read_metadata(path)
    reader = _Reader(path, meta)
    out: dict[str, Tensor] = {}
    stored: dict[str, Tensor] = {}
    for key in meta["keys"]:
        src = meta["aliases"].get(key, key)
        if src not in stored:
            stored[src] = reader.full(f"model/{src}")
        out[key] = stored[src]
    return out
