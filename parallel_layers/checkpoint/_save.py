"""save() and async_save(): every rank writes its pieces through DCP; rank 0 commits.

Collectives, on the group (default: the world), in order: all-gather of each rank's local
error and layout signature, broadcast of the partial directory, DCP's own (about ten: plan
exchange, write results, metadata), broadcast of the commit result. Each is also where
errors meet (Note [errors on every rank]); DCP raises its own failures on every rank.

Replicated pieces (DP replicas, TP-replicated norms, Adam's `step`) are described the same
way by every holder, and DCP writes identical chunks once.

Note [asynchronous save]: `async_save` copies every tensor it will write to host memory
(the staging: one copy of this rank's shards and optimizer state) and returns; a background
thread then runs the DCP save and the commit on a process group of its own (gloo), so its
collectives never interleave with the training loop's. Training may change the parameters
as soon as `async_save` returns. One save is in flight at a time: the next save (either
kind) first waits for the previous one.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from parallel_layers.checkpoint import _io
from parallel_layers.checkpoint._dist import all_gather, broadcast, describe_error, quiet, raise_if_any, rank_world
from parallel_layers.checkpoint._state import MODEL, OPTIMIZER, RNG, model_state, optimizer_state, rng_state
from parallel_layers.placement import ModelPlacement, describe


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, recording the size and CRC-32 of each file this rank wrote (Note
    [atomic save] in _io.py)."""

    def __init__(self, path: str, rank: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._pl_rank = rank

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        _io.record_written(str(self.path), self._pl_rank, {r.storage_data.relative_path for r in results})
        return future


def _check_extra(extra) -> dict:
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'step': 100, 'samples_seen': 6400}}), got "
                        f"{type(extra).__name__}")
    try:
        return json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold only JSON values (numbers, strings, lists, dicts): {e}") from e


def tied_names(described: ModelPlacement) -> list[list[str]]:
    """Each group of state_dict keys this rank holds as one tensor (a tied weight's), sorted:
    recorded at save, so that a load into a model that ties keys the checkpoint holds apart can
    say so (Note [ties in a checkpoint] in _load.py)."""
    return sorted({tuple(sorted((tp.name, *tp.aliases))) for tp in described.tensors.values() if tp.aliases})


def layout_signature(described: ModelPlacement, world: int) -> str:
    """A digest of which pieces this rank holds, and of the world size: equal on every rank at
    save and at load <=> the same layout (then the RNG state is restored)."""
    desc = [(name, [(p.global_offsets, p.sizes, p.local_offsets, p.flat_offset) for p in tp.pieces])
            for name, tp in described.tensors.items()]
    return hashlib.sha1(json.dumps([world, desc]).encode()).hexdigest()


def _staged_copies(described: ModelPlacement, optimizer) -> dict[int, Tensor]:
    """id(tensor) -> a host copy, for every tensor an asynchronous save writes."""
    tensors = [tp.local for tp in described.tensors.values()]
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, Tensor)]
    copies = {}
    for t in tensors:
        if id(t) not in copies:
            copies[id(t)] = torch.empty_like(t, device="cpu").copy_(t.detach())
    return copies


def _begin(directory: str, step: int, model, optimizer, extra, group, prefix: str, stage: bool):
    """Checks, the state dict to write, the partial directory, what rank 0 will commit."""
    rank, world = rank_world(group)
    mine = state = signature = None
    ties: list[list[str]] = []
    try:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"checkpoint save: directory must be a str or os.PathLike (the checkpoint root), got "
                            f"{directory!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra = _check_extra(extra)
        described = describe(model, prefix)
        described.check_storage()
        copies = _staged_copies(described, optimizer) if stage else None
        state = {MODEL: model_state(described, copies), RNG: rng_state(rank)}
        if optimizer is not None:
            state[OPTIMIZER] = optimizer_state(optimizer, described, copies)
        signature = layout_signature(described, world)
        ties = tied_names(described)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = e
    gathered = all_gather((describe_error(mine) if mine else None, signature, optimizer is not None, ties), group)
    raise_if_any([g[0] for g in gathered], mine, "checkpoint save")
    with_opt = [g[2] for g in gathered]
    if any(with_opt) and not all(with_opt):
        raise ValueError(f"an optimizer was passed on ranks {[r for r, o in enumerate(with_opt) if o]} only; pass "
                         "this rank's optimizer on every rank, or none")
    partial = err = None
    if rank == 0:
        try:
            partial = _io.start(directory, step)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            err = describe_error(e)
    partial, err = broadcast((partial, err), group)
    if err is not None:
        raise RuntimeError(f"checkpoint save: rank 0 could not create a directory under {directory!r}: {err}")
    ours = {"format": _io.FORMAT, "step": step, "world_size": world, "extra": extra,
            "signatures": [g[1] for g in gathered], "optimizer": all(with_opt),
            "tied": sorted({tuple(names) for g in gathered for names in g[3]})}
    return state, partial, ours


def _write_and_commit(state: dict, partial: str, ours: dict, group) -> str:
    rank, _ = rank_world(group)
    quiet(dcp.save)(state, storage_writer=_Writer(partial, rank), process_group=group, no_dist=not dist.is_initialized())
    final = err = None
    if rank == 0:
        try:
            final = _io.commit(partial, ours)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            err = describe_error(e)
    final, err = broadcast((final, err), group)
    if err is not None:
        raise RuntimeError(f"checkpoint save: rank 0 could not commit {partial!r}: {err}")
    return final


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_in_flight: concurrent.futures.Future | None = None
_async_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _wait_in_flight() -> None:
    global _in_flight
    if _in_flight is not None:
        previous, _in_flight = _in_flight, None
        previous.result()


def save(directory: str, step: int, model, optimizer=None, *, extra: dict | None = None, group=None,
         prefix: str = "") -> str:
    """Save `model` (and `optimizer`, RNG, `extra`) as <directory>/step_<step>; a collective.

    model: the model as trained - plain, tensor parallel, DataParallel, ZeRO (then pass
    zero.optimizer) or PipelineStages. extra: JSON values to get back from load (data
    position, step, epoch). prefix: prepended to the model's keys (pipeline stages, see
    PipelineStages.state_placement). Returns the checkpoint's path once it is committed.
    """
    model, optimizer, prefix = unwrap(model, optimizer, prefix)
    _wait_in_flight()
    state, partial, ours = _begin(directory, step, model, optimizer, extra, group, prefix, stage=False)
    return _write_and_commit(state, partial, ours, group)


class AsyncSave:
    """What `async_save` returns: `result()` waits for the commit and returns the path."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        global _in_flight
        try:
            path = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except BaseException:
            # reported here: the next save, load or latest_checkpoint must not raise it again
            # (review finding: a recovery load failed with the earlier save's error)
            if _in_flight is self._future:
                _in_flight = None
            raise
        if _in_flight is self._future:
            _in_flight = None
        return path


def _async_group(group) -> dist.ProcessGroup | None:
    if not dist.is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _async_groups:
        _async_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _async_groups[ranks]


def async_save(directory: str, step: int, model, optimizer=None, *, extra: dict | None = None, group=None,
               prefix: str = "") -> AsyncSave:
    """`save`, with the writing in the background (Note [asynchronous save]); a collective.
    Returns once this rank's tensors are copied to host memory."""
    global _executor, _in_flight
    model, optimizer, prefix = unwrap(model, optimizer, prefix)
    _wait_in_flight()
    background = _async_group(group)
    state, partial, ours = _begin(directory, step, model, optimizer, extra, group, prefix, stage=True)
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
    _in_flight = _executor.submit(_write_and_commit, state, partial, ours, background)
    return AsyncSave(_in_flight)


def latest_checkpoint(root: str, verify: bool = True) -> str | None:
    """The newest complete checkpoint under `root` that passes its integrity check, or None;
    first waits for this process's asynchronous save in flight, if any, so that every rank that
    calls it after the same saves sees the same checkpoints (Note [one checkpoint on every rank]
    in _load.py).

    The one `latest` names comes first (a run restarted from an earlier step resumes from what
    it saved last), then the others, newest step first. A checkpoint that fails its check
    (Note [integrity] in _io.py) is skipped with a warning."""
    _wait_in_flight()
    return _io.latest_checkpoint(root, verify)


def unwrap(model, optimizer, prefix: str):
    """(module, optimizer, prefix) of what names them - the `Parallelized` of parallelize, by its
    `checkpoint_parts()` (the checkpoint reads the placement only, not the wrappers: tests/
    test_structure.py) - else as given."""
    parts = getattr(type(model), "checkpoint_parts", None)
    if parts is None:
        return model, optimizer, prefix
    module, own, own_prefix = parts(model)
    if optimizer is not None and optimizer is not own:
        raise ValueError(f"checkpoint: given a {type(model).__name__}, pass no optimizer (its own is used) or that "
                         "optimizer itself")
    return module, own, prefix or own_prefix


def wait() -> None:
    """Wait for an asynchronous save in flight, if any (raising its error)."""
    _wait_in_flight()


__all__ = ["AsyncSave", "async_save", "latest_checkpoint", "save", "wait"]
