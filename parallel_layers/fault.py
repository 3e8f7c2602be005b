"""When a collective fails, say which rank is to blame and where every rank is.

    with fault.collective("all_reduce", group):
        dist.all_reduce(x, group=group)
    fault.wait(work, "all_gather", group)        # the wait of an async collective

Note [collective watchdog]: a peer that dies makes gloo raise at once ("Connection closed by
peer [127.0.0.1]:port"), a peer that hangs makes it raise after the process group's timeout
(init_parallel(timeout_s=...)); neither message names the rank or the collective. So every
collective of the library runs inside `collective()`, which records on this rank what it is
in (name, group, how many collectives of that group came before), and a daemon thread
publishes that record with a heartbeat counter to the process group's store once a second.
When a collective raises, `collective()` reads its peers' records twice, `diagnose_after_s`
apart, and raises a CollectiveError that names, for each peer: stopped (no new heartbeat:
dead or frozen), alive outside any collective (busy or hung in its own code), alive in
another collective (the ranks disagree on the order: a desync), or in this same collective.
The record costs a few attribute writes per collective; nothing is sent per collective.
With PARALLEL_LAYERS_DEBUG=1, `check_agreement` runs before each of the library's
collectives: one small all-gather of (op, shape, dtype) that turns a mismatch into an error
on every rank of the group before it can hang or corrupt data.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import torch.distributed as dist

HEARTBEAT_S = 1.0
_KEY = "parallel_layers/heartbeat/{}"


class CollectiveError(RuntimeError):
    """A collective failed; the message names the ranks that did not take part, and why."""


class _Local:
    """What this rank is in now, and how many collectives of each group it has entered."""

    def __init__(self):
        self.current: dict | None = None
        self.counts: dict[str, int] = {}
        self.heartbeat: threading.Thread | None = None
        self.pid = None


_local = _Local()


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _store():
    return dist.distributed_c10d._get_default_store()


def _beat_forever(store, rank: int) -> None:
    beat = 0
    host = socket.gethostname()
    while True:
        beat += 1
        record = {"beat": beat, "pid": os.getpid(), "host": host, "current": _local.current}
        try:
            store.set(_KEY.format(rank), json.dumps(record))
        except Exception:  # noqa: BLE001 - the store went away (job ending): stop beating
            return
        time.sleep(HEARTBEAT_S)


def _ensure_heartbeat() -> None:
    if _local.heartbeat is not None and _local.pid == os.getpid() and _local.heartbeat.is_alive():
        return
    if not dist.is_initialized():
        return
    _local.pid = os.getpid()  # a forked child needs its own thread
    _local.heartbeat = threading.Thread(target=_beat_forever, args=(_store(), dist.get_rank()), daemon=True,
                                        name="parallel_layers-heartbeat")
    _local.heartbeat.start()


def _read(store, ranks: list[int]) -> dict[int, dict | None]:
    out = {}
    for r in ranks:
        key = _KEY.format(r)
        try:
            out[r] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store itself is gone (its host died)
            out[r] = None
    return out


def _where(record: dict | None) -> str:
    cur = record and record.get("current")
    if not cur:
        return "outside any collective"
    return f"in {cur['name']} #{cur['count']} of group {cur['ranks']} (for {time.time() - cur['since']:.1f} s)"


def diagnose(name: str, ranks: list[int], count: int, wait_s: float = 2.5 * HEARTBEAT_S) -> str:
    """One line per peer of `ranks`: stopped, or where it is."""
    me = dist.get_rank()
    peers = [r for r in ranks if r != me]
    try:
        store = _store()
        first = _read(store, peers)
        time.sleep(wait_s)
        second = _read(store, peers)
    except Exception as e:  # noqa: BLE001
        return f"the peers' heartbeats could not be read ({e})"
    lines = []
    for r in peers:
        a, b = first[r], second[r]
        if b is None:
            lines.append(f"rank {r}: no heartbeat at all (never reached a collective, or the store is gone)")
        elif a is not None and a["beat"] == b["beat"]:
            lines.append(f"rank {r} (pid {b['pid']} on {b['host']}): STOPPED - no heartbeat for {wait_s:.1f} s "
                         f"(dead or frozen); last seen {_where(b)}")
        elif not b.get("current"):
            lines.append(f"rank {r}: alive but outside any collective - it has not reached this one (busy or hung "
                         "in its own code)")
        elif (b["current"]["name"], b["current"]["ranks"], b["current"]["count"]) != (name, ranks, count):
            lines.append(f"rank {r}: alive but {_where(b)} - the ranks disagree on the order of collectives")
        else:
            lines.append(f"rank {r}: alive and in this same collective")
    return "; ".join(lines)


@contextlib.contextmanager
def collective(name: str, group=None):
    """Record that this rank is in collective `name` of `group` while the block runs; turn a
    failure into a CollectiveError that says where each peer is (Note [collective watchdog])."""
    if not dist.is_initialized():
        yield
        return
    _ensure_heartbeat()
    ranks = _ranks(group)
    key = ",".join(map(str, ranks))
    count = _local.counts[key] = _local.counts.get(key, 0) + 1
    outer = _local.current
    _local.current = {"name": name, "ranks": ranks, "count": count, "since": time.time()}
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo / NCCL errors and timeouts
        raise CollectiveError(f"{name} #{count} of group {ranks} failed on rank {dist.get_rank()} after "
                              f"{time.time() - _local.current['since']:.1f} s: {diagnose(name, ranks, count)}. "
                              f"Cause: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    finally:
        _local.current = outer


def check_agreement(op: str, x, group) -> None:
    """With PARALLEL_LAYERS_DEBUG=1: all ranks of `group` must be about to run the same
    collective on the same shape and dtype; raise on every rank if not.

    A mismatch (a rank that skipped a layer, a shape that differs) otherwise hangs or
    corrupts data. The check costs one small collective per collective, so it is opt-in.
    """
    if os.environ.get("PARALLEL_LAYERS_DEBUG") != "1" or not dist.is_initialized() or \
            dist.get_world_size(group) == 1:
        return
    mine = (op, tuple(x.shape), str(x.dtype))
    everyone: list = [None] * dist.get_world_size(group)
    with collective("debug agreement check", group):
        dist.all_gather_object(everyone, mine, group=group)
    if any(f != mine for f in everyone):
        ranks = _ranks(group)
        detail = "; ".join(f"rank {r}: {op_} {shape} {dtype}" for r, (op_, shape, dtype) in zip(ranks, everyone))
        raise RuntimeError(f"PARALLEL_LAYERS_DEBUG: ranks disagree on the next collective of group {ranks}: {detail}")


def wait(work, name: str, group=None) -> None:
    """Wait for an async collective's work handle under `collective()`."""
    if work is None:
        return
    with collective(name, group):
        work.wait()
