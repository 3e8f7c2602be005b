"""Checkpoint files on disk: naming, atomic commit, discovery and safe reading.

    <root>/step_<N>/rank<r>.pt      each rank's pieces: torch.save of a dict str -> Tensor
    <root>/step_<N>/metadata.json   the piece table, optimizer scalars, extra; written last
    <root>/latest                   "step_<N>", replaced atomically after each commit

Note [atomic save]: ranks write into <root>/step_<N>.partial-<token>/. Once every rank has
written and fsynced its file, rank 0 writes metadata.json, fsyncs it and the directory,
renames the directory to step_<N> (atomic on POSIX) and fsyncs <root>; only then is
`latest` replaced (temp file + os.replace). A checkpoint is complete iff its directory is
named step_<N> and holds metadata.json; partial directories are never read and are removed
by the next save. Re-saving an existing step moves the old directory aside first
(step_<N>.old-<token>, also removed by the next save).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import shutil

import torch
from torch import Tensor

FORMAT = "parallel_layers.checkpoint/1"
METADATA = "metadata.json"
LATEST = "latest"
_COMPLETE = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(partial|old)-[0-9a-f]+$")


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: str, tensors: dict[str, Tensor]) -> int:
    """torch.save + fsync; returns the file's size in bytes."""
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def start(root: str, step: int) -> str:
    """Remove leftovers of interrupted saves; create and return a fresh partial directory."""
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        if _LEFTOVER.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    partial = os.path.join(root, f"step_{step}.partial-{secrets.token_hex(4)}")
    os.mkdir(partial)
    return partial


def commit(partial: str, metadata: dict) -> str:
    """Make `partial` the complete checkpoint step_<N> (Note [atomic save]); returns its path."""
    _write_json(os.path.join(partial, METADATA), metadata)
    _fsync_dir(partial)
    root = os.path.dirname(partial)
    name = f"step_{metadata['step']}"
    final = os.path.join(root, name)
    old = None
    if os.path.exists(final):
        old = os.path.join(root, f"{name}.old-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(root)
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def is_complete(path: str) -> bool:
    return bool(_COMPLETE.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(
        os.path.join(path, METADATA))


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under `root`, oldest step first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), e) for e in os.listdir(root) if (m := _COMPLETE.match(e))]
    return [os.path.join(root, e) for _, e in sorted(found) if is_complete(os.path.join(root, e))]


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint `latest` names if it is complete, else the highest complete step, else None.

    `latest` wins over the highest step so that a run restarted from an earlier step (after a
    loss spike, say) resumes from what it saved last."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            named = f.read().strip()
    except OSError:
        named = ""
    if _COMPLETE.match(named) and is_complete(os.path.join(root, named)):
        return os.path.join(root, named)
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_metadata(path: str) -> dict:
    """The metadata of the complete checkpoint at `path`; a clear error for anything else."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike (a step_<N> directory), got {path!r}; note "
                        "that latest_checkpoint(root) returns None when root holds no complete checkpoint")
    if not is_complete(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        found = [os.path.basename(p) for p in complete_checkpoints(parent)] + (
            [os.path.basename(p) for p in complete_checkpoints(path)] if os.path.isdir(path) else [])
        why = ("does not exist" if not os.path.exists(path) else
               "is an unfinished save (partial)" if ".partial-" in os.path.basename(path) else
               "is not a complete checkpoint (a step_<N> directory with metadata.json)")
        raise FileNotFoundError(f"checkpoint {path!r} {why}; complete checkpoints found next to or under it: "
                                f"{found or 'none'} (latest_checkpoint(root) picks the newest)")
    with open(os.path.join(path, METADATA)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_tensors(path: str, expected_bytes: int | None) -> dict[str, Tensor]:
    """A rank file, with weights_only semantics: a dict of str -> Tensor, nothing else."""
    size = os.path.getsize(path)
    if expected_bytes is not None and size != expected_bytes:
        raise ValueError(f"{path} has {size} bytes, the checkpoint metadata says {expected_bytes}: truncated or "
                         "replaced after the save")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"refusing to load {path}: it holds objects other than tensors, and checkpoints "
                                     f"are read with weights_only=True, never as arbitrary pickle ({e})") from None
    bad = ([f"{type(obj).__name__} (not a dict)"] if not isinstance(obj, dict) else
           [f"{k!r}: {type(v).__name__}" for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, Tensor))])
    if bad:
        raise pickle.UnpicklingError(f"refusing to load {path}: a rank file must be a dict of str -> Tensor, found "
                                     f"{', '.join(bad[:5])}")
    return obj
