"""The few collectives a save or load needs, and errors that every rank raises together.

Note [errors on every rank]: an exception on one rank while its peers enter the next
collective is a hang (docs/parallelism.md). Save and load therefore catch local errors,
exchange them in the next collective they issue anyway, and raise on every rank: the rank
that failed re-raises its own exception, the others a RuntimeError naming it. Without
torch.distributed initialised everything is rank 0 of 1 and nothing is communicated.
"""

from __future__ import annotations

import functools
import warnings

import torch.distributed as dist

from parallel_layers import fault


def rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(obj, group, what: str = "checkpoint") -> list:
    """Every rank's `obj` (picklable; small metadata only), by rank; `what` names the caller in
    the watchdog's messages."""
    _, world = rank_world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    with fault.collective(f"{what} all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, group):
    """Rank 0's `obj` on every rank."""
    _, world = rank_world(group)
    if world == 1:
        return obj
    box = [obj]
    with fault.collective("checkpoint broadcast_object_list", group):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def raise_if_any(errors: list[str | None], mine: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank reported an error (Note [errors on every rank])."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if mine is not None:
        raise mine
    listed = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise RuntimeError(f"{what} failed on {len(failed)} rank(s): {listed}")


def quiet(fn):
    """`fn` (dcp.save / dcp.load) without DCP's warning that one process without
    torch.distributed means a single-process checkpoint: that is what we asked for."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return fn(*args, **kwargs)
    return call
