"""Convert a checkpoint of parallel_layers' first format into a DCP checkpoint; one process.

    python -m parallel_layers.checkpoint.convert OLD/step_<N> NEW_ROOT     # writes NEW_ROOT/step_<N>

The first format (until issue 15) was `rank<r>.pt` files (torch.save of str -> Tensor pieces)
and `metadata.json` (a piece table: each piece a box of a logical tensor, optionally narrowed
to a row-major element range, with its owning rank and CRC-32). Every logical tensor is
assembled, checked against its CRCs, and written whole; the result loads at any layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from parallel_layers.checkpoint import _io
from parallel_layers.checkpoint._dist import quiet
from parallel_layers.checkpoint._save import _Writer
from parallel_layers.checkpoint._state import MODEL, OPTIMIZER

OLD_FORMAT = "parallel_layers.checkpoint/1"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the old metadata")
    return dtype


def _write_piece(full: Tensor, piece: dict, data: Tensor) -> None:
    region = full
    for dim, (o, n) in enumerate(zip(piece["offsets"], piece["sizes"])):
        region = region.narrow(dim, o, n)
    if piece["flat"] is None:
        region.copy_(data.view(region.shape))
        return
    a, b = piece["flat"]
    flat = region.reshape(-1).clone()
    flat[a:b] = data.reshape(-1)
    region.copy_(flat.view(region.shape))


class _OldReader:
    def __init__(self, path: str):
        with open(os.path.join(path, "metadata.json")) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != OLD_FORMAT:
            raise ValueError(f"{path}: format {self.meta.get('format')!r} is not {OLD_FORMAT!r}")
        self.path, self._files = path, {}

    def _file(self, rank: int) -> dict[str, Tensor]:
        if rank not in self._files:
            name = f"rank{rank}.pt"
            self._files[rank] = torch.load(os.path.join(self.path, name), map_location="cpu", weights_only=True,
                                           mmap=True)
        return self._files[rank]

    def full(self, logical: str) -> Tensor:
        info = self.meta["tensors"][logical]
        out = torch.zeros(info["shape"], dtype=_dtype(info["dtype"]))
        for p in info["pieces"]:
            data = self._file(p["rank"])[p["key"]]
            numel = p["flat"][1] - p["flat"][0] if p["flat"] is not None else math.prod(p["sizes"])
            crc = zlib.crc32(data.contiguous().reshape(-1).view(torch.uint8).numpy())
            if data.numel() != numel or crc != p["crc32"]:
                raise ValueError(f"rank{p['rank']}.pt of {self.path}: {p['key']!r} does not match its size or CRC-32")
            _write_piece(out, p, data)
        return out


def convert(old: str, new_root: str) -> str:
    """Write the old-format checkpoint `old` as <new_root>/step_<N>; returns that path."""
    reader = _OldReader(old)
    meta = reader.meta
    model = {}
    for key in meta["keys"]:
        model[key] = reader.full(f"model/{meta['aliases'].get(key, key)}")
    state = {MODEL: model}
    record = meta["optimizer"]
    if record is not None:
        optim = {}
        for name, tensors in record["tensors"].items():
            for key, logical in tensors.items():
                optim[f"state.{name}.{key}"] = reader.full(logical)
        for name, scalars in record["scalars"].items():
            for key, s in scalars.items():
                optim[f"state.{name}.{key}"] = torch.tensor(s["value"], dtype=_dtype(s["dtype"])) if s["dtype"] \
                    else s["value"]
        for name, gi in record["group_of"].items():
            for key, value in record["param_groups"][gi].items():
                optim[f"param_groups.{name}.{key}"] = tuple(value) if key == "betas" else value
        state[OPTIMIZER] = optim
    partial = _io.start(new_root, meta["step"])
    quiet(dcp.save)(state, storage_writer=_Writer(partial, 0), no_dist=True)
    return _io.commit(partial, {"format": _io.FORMAT, "step": meta["step"], "world_size": 1, "extra": meta["extra"],
                                "signatures": [None], "optimizer": record is not None})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="a step_<N> directory in the old format")
    parser.add_argument("new_root", help="where to write step_<N> in the DCP format")
    args = parser.parse_args(argv)
    print(convert(args.old, args.new_root))


if __name__ == "__main__":
    main()
