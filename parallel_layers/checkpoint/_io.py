"""Checkpoint directories: naming, atomic commit, integrity, discovery.

    <root>/step_<N>/.metadata            DCP's metadata (written by DCP's coordinator, rank 0)
    <root>/step_<N>/__<r>_<i>.distcp     rank r's chunks (DCP's FileSystemWriter)
    <root>/step_<N>/parallel_layers.json step, `extra`, layout signatures, size and CRC-32 of
                                         every file above; written last
    <root>/latest                        "step_<N>", replaced atomically after each commit

A step directory is an ordinary DCP checkpoint: `dcp.load(..., checkpoint_id=<root>/step_<N>)`
reads it without parallel_layers; parallel_layers.json is ours, beside DCP's files.

Note [atomic save]: ranks write into <root>/step_<N>.partial-<token>/. Each rank records the
size and CRC-32 of the files it wrote (`integrity-<r>.json`) as it finishes them; after DCP's
coordinator wrote .metadata, rank 0 folds those records and .metadata's into
parallel_layers.json, fsyncs it and the directory, renames the directory to step_<N> (atomic
on POSIX), fsyncs <root>, and only then replaces `latest` (temp file + os.replace). A
checkpoint of ours is complete iff its directory is named step_<N> and holds
parallel_layers.json; partial directories are never read and are removed by the next save.
Re-saving an existing step moves the old directory aside first.

Note [integrity]: DCP has no checksums. `verify(path)` checks every file's size and CRC-32
against parallel_layers.json (it reads the whole checkpoint); `latest_checkpoint` runs it on
its candidate and falls back, with a warning, to the newest checkpoint that passes. `load`
checks file sizes only (cheap), since it reads just the byte ranges a rank needs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import warnings
import zlib

FORMAT = "parallel_layers.checkpoint/2"
OURS = "parallel_layers.json"
DCP_METADATA = ".metadata"
LATEST = "latest"
_COMPLETE = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(partial|old)-[0-9a-f]+$")
_INTEGRITY = re.compile(r"^integrity-(\d+)\.json$")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def file_record(path: str) -> dict:
    """{"bytes", "crc32"} of a file, read in 16 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": os.path.getsize(path), "crc32": crc}


def record_written(directory: str, rank: int, relative_paths) -> None:
    """Rank `rank` finished writing these files (Note [atomic save])."""
    records = {name: file_record(os.path.join(directory, name)) for name in sorted(set(relative_paths))}
    _write_json(os.path.join(directory, f"integrity-{rank}.json"), records)


def start(root: str, step: int) -> str:
    """Remove leftovers of interrupted saves; create and return a fresh partial directory."""
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        if _LEFTOVER.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    partial = os.path.join(root, f"step_{step}.partial-{secrets.token_hex(4)}")
    os.mkdir(partial)
    return partial


def commit(partial: str, ours: dict) -> str:
    """Make `partial` the complete checkpoint step_<N> (Note [atomic save]); returns its path."""
    files = {}
    for entry in sorted(os.listdir(partial)):
        if _INTEGRITY.match(entry):
            with open(os.path.join(partial, entry)) as f:
                files.update(json.load(f))
    missing = [r for r in range(ours["world_size"]) if not os.path.exists(os.path.join(partial, f"integrity-{r}.json"))]
    if missing or not os.path.exists(os.path.join(partial, DCP_METADATA)):
        raise OSError(f"{partial}: ranks {missing} recorded no files, or DCP wrote no {DCP_METADATA}")
    files[DCP_METADATA] = file_record(os.path.join(partial, DCP_METADATA))
    for entry in os.listdir(partial):
        if _INTEGRITY.match(entry):
            os.remove(os.path.join(partial, entry))
    _write_json(os.path.join(partial, OURS), {**ours, "files": files})
    _fsync_dir(partial)
    root = os.path.dirname(partial)
    name = f"step_{ours['step']}"
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
    return bool(_COMPLETE.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(os.path.join(path, OURS))


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under `root`, oldest step first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), e) for e in os.listdir(root) if (m := _COMPLETE.match(e))]
    return [os.path.join(root, e) for _, e in sorted(found) if is_complete(os.path.join(root, e))]


def read_ours(path: str) -> dict:
    with open(os.path.join(path, OURS)) as f:
        ours = json.load(f)
    if ours.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {ours.get('format')!r}, expected {FORMAT!r}")
    return ours


def problems(path: str, crc: bool = True) -> list[str]:
    """What is wrong with the files of our checkpoint at `path` (Note [integrity]); [] if nothing."""
    try:
        ours = read_ours(path)
    except (OSError, ValueError) as e:
        return [f"{OURS}: {e}"]
    found = []
    for name, expected in ours["files"].items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            found.append(f"{name} is missing")
        elif os.path.getsize(full) != expected["bytes"]:
            found.append(f"{name} has {os.path.getsize(full)} bytes, {expected['bytes']} were written")
        elif crc and file_record(full)["crc32"] != expected["crc32"]:
            found.append(f"{name} does not match the CRC-32 recorded at save")
    return found


def verify(path: str) -> None:
    """Raise unless every file of the checkpoint at `path` has its recorded size and CRC-32."""
    found = problems(path)
    if found:
        raise ValueError(f"checkpoint {path} is corrupt: {'; '.join(found)}")


def latest_checkpoint(root: str, verify: bool = True) -> str | None:
    """The newest complete checkpoint under `root` that passes its integrity check, or None.

    The one `latest` names comes first (a run restarted from an earlier step resumes from what
    it saved last), then the others, newest step first. A checkpoint that fails its check
    (Note [integrity]) is skipped with a warning."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            named = f.read().strip()
    except OSError:
        named = ""
    candidates = list(reversed(complete_checkpoints(root)))
    if _COMPLETE.match(named) and os.path.join(root, named) in candidates:
        candidates.remove(os.path.join(root, named))
        candidates.insert(0, os.path.join(root, named))
    for path in candidates:
        found = problems(path) if verify else []
        if not found:
            return path
        warnings.warn(f"checkpoint {path} is corrupt ({'; '.join(found)}); falling back to an older one",
                      RuntimeWarning, stacklevel=2)
    return None


def identity(path: str) -> dict:
    """What names the checkpoint at `path` whatever its path (Note [one checkpoint on every rank]
    in _load.py): {"path", "what", "digest"}."""
    if os.path.isfile(os.path.join(path, OURS)):
        ours = read_ours(path)
        digest = zlib.crc32(json.dumps(ours.get("files", {}), sort_keys=True).encode())
        return {"path": path, "what": f"step {ours.get('step')}", "digest": digest}
    record = file_record(os.path.join(path, DCP_METADATA))
    return {"path": path, "what": f"{DCP_METADATA} of {record['bytes']} bytes", "digest": record["crc32"]}


def check_path(path) -> str:
    """`path` as a str if it is a DCP checkpoint directory (ours or anyone's); a clear error else."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike (a step_<N> directory), got {path!r}; note "
                        "that latest_checkpoint(root) returns None when root holds no complete checkpoint")
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, DCP_METADATA)) and ".partial-" not in os.path.basename(path):
        return path
    if _COMPLETE.match(os.path.basename(os.path.normpath(path))) and os.path.isfile(os.path.join(path, OURS)):
        raise FileNotFoundError(f"checkpoint {path!r} lacks DCP's {DCP_METADATA} (deleted or never written); its "
                                f"other files are there. latest_checkpoint(root) (verify=True, its default) skips such "
                                "a checkpoint")
    if os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(f"{path} is a checkpoint in parallel_layers' old format (rank<r>.pt + metadata.json); "
                         f"convert it once with: python -m parallel_layers.checkpoint.convert {path} <new directory>")
    parent = os.path.dirname(os.path.normpath(path)) or "."
    found = [os.path.basename(p) for p in complete_checkpoints(parent)] + (
        [os.path.basename(p) for p in complete_checkpoints(path)] if os.path.isdir(path) else [])
    why = ("does not exist" if not os.path.exists(path) else
           "is an unfinished save (partial)" if ".partial-" in os.path.basename(path) else
           f"is not a complete checkpoint (a directory with DCP's {DCP_METADATA})")
    raise FileNotFoundError(f"checkpoint {path!r} {why}; complete checkpoints found next to or under it: "
                            f"{found or 'none'} (latest_checkpoint(root) picks the newest)")
