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

The heartbeat stops (an Event, then the thread joined) in `stop_heartbeat()`, which
`parallel_layers.shutdown()` calls before `destroy_process_group`, and at interpreter exit
(atexit runs before Python starts finalizing); it also stops by itself within one beat once
the default process group it beats for is destroyed (a plain `dist.destroy_process_group()`).
Why it must stop: `Store.set` releases the GIL while it talks to the store; a daemon thread
that comes back from it after Python began finalizing is ended by `pthread_exit`, whose forced
unwind meets pybind11's noexcept `~gil_scoped_release` and calls `std::terminate`: "terminate
called without an active exception", SIGABRT, and torchrun reports the job failed. The thread
keeps its own reference to the store, so a store that torch drops is never destroyed under it.

On NCCL a launch returns at once and `work.wait()` only makes the stream wait, so a dead or
hung peer seldom raises inside `collective()`. There torch's own machinery is the watchdog,
and `init_parallel` turns it on (`nccl_env_defaults`, variables the user set win): async error
handling (a collective that fails or outlives the process group's timeout tears the process
down, so torchrun sees a failure and can restart the job instead of hanging), and the flight
recorder, which dumps each rank's last collectives to `<prefix><rank>` on a timeout; gathered
in one directory, `torchfrtrace <dir>` names the rank and the collective that diverged. A
CollectiveError on NCCL (a launch that raises: an aborted communicator, TORCH_NCCL_BLOCKING_WAIT)
points at that dump. docs/faults.md says what runs on gloo, what is only modelled for NCCL, and
why.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Mapping

import torch.distributed as dist

HEARTBEAT_S = 1.0
_KEY = "parallel_layers/heartbeat/{}"


# torch's NCCL safety net (Note [collective watchdog]): each variable under the names torch
# 2.14 reads, first name first, and the value init_parallel gives it when none of them is set.
NCCL_SAFETY_ENV = (
    # 1 = tear down: a collective that fails or times out kills the process (torchrun's own default)
    (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "1"),
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),  # flight-recorder entries kept
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    (("TORCH_NCCL_ENABLE_MONITORING",), "1"),  # the dump on timeout runs in the monitor thread
)
DUMP_PREFIX_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def _first_set(environ: Mapping[str, str], names) -> str | None:
    return next((environ[n] for n in names if environ.get(n)), None)


def _cache_dir(environ: Mapping[str, str]) -> str:
    return environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "/tmp"), ".cache")


def flight_recorder_prefix(environ: Mapping[str, str]) -> str:
    """Where torch's flight recorder writes rank r's dump: `<prefix>r`. torch 2.14 reads
    TORCH_FR_DUMP_TEMP_FILE, then TORCH_NCCL_DEBUG_INFO_TEMP_FILE, else uses
    $XDG_CACHE_HOME (or $HOME/.cache) + /torch/comm_lib_trace_rank_."""
    return _first_set(environ, DUMP_PREFIX_ENV) or os.path.join(_cache_dir(environ), "torch", "comm_lib_trace_rank_")


def nccl_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables `init_parallel` sets before creating an NCCL process group: those of
    NCCL_SAFETY_ENV the user has not set under any name, and a dump prefix in a directory of
    this job's own (one per torchrun run id), which `torchfrtrace <dir>` reads as it is."""
    out = {names[0]: value for names, value in NCCL_SAFETY_ENV if _first_set(environ, names) is None}
    if _first_set(environ, DUMP_PREFIX_ENV) is None:
        job = environ.get("TORCHELASTIC_RUN_ID") or "default"
        out[DUMP_PREFIX_ENV[0]] = os.path.join(_cache_dir(environ), "torch", "flight_recorder", job, "rank_")
    return out


def _flight_recorder_hint(group) -> str:
    """For NCCL groups: where this failure's flight-recorder dumps are and how to read them."""
    try:
        if "nccl" not in str(dist.get_backend(group)):
            return ""
    except (RuntimeError, ValueError):
        return ""
    prefix = flight_recorder_prefix(os.environ)
    return (f". NCCL flight recorder: on a timeout each rank dumps its last collectives to {prefix}<rank> on its "
            f"node (this rank: {prefix}{dist.get_rank()}); copy every rank's file into one directory and run "
            f"`torchfrtrace <dir>` (or `python -m torch.distributed.flight_recorder.fr_trace <dir>`) to see which "
            f"rank and collective diverged (docs/faults.md)")


class CollectiveError(RuntimeError):
    """A collective failed; the message names the ranks that did not take part, and why."""


class _Local:
    """What this rank is in now, and how many collectives of each group it has entered."""

    def __init__(self):
        self.current: dict | None = None
        self.counts: dict[str, int] = {}
        self.heartbeat: _Heartbeat | None = None


_local = _Local()


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _store():
    return dist.distributed_c10d._get_default_store()


class _Heartbeat:
    """A daemon thread that publishes this rank's record to `store` every HEARTBEAT_S until
    stopped, or until the default process group it was started for is destroyed."""

    def __init__(self, store, rank: int):
        self.store, self.rank, self.pid = store, rank, os.getpid()
        self.world = dist.distributed_c10d.GroupMember.WORLD
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="parallel_layers-heartbeat")
        self.thread.start()

    def _run(self) -> None:
        beat, host = 0, socket.gethostname()
        while not self.stopping.is_set() and dist.distributed_c10d.GroupMember.WORLD is self.world:
            beat += 1
            record = {"beat": beat, "pid": self.pid, "host": host, "current": _local.current}
            try:
                self.store.set(_KEY.format(self.rank), json.dumps(record))
            except Exception:  # noqa: BLE001 - the store went away (job ending): stop beating
                return
            self.stopping.wait(HEARTBEAT_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)  # a store call in flight returns within its own timeout


def _ensure_heartbeat() -> None:
    hb = _local.heartbeat
    if not dist.is_initialized() or (hb is not None and hb.pid == os.getpid() and hb.thread.is_alive()
                                     and hb.world is dist.distributed_c10d.GroupMember.WORLD):
        return
    stop_heartbeat()  # one beating for a destroyed process group (it would stop within a beat)
    _local.heartbeat = _Heartbeat(_store(), dist.get_rank())  # a forked child gets its own thread


def stop_heartbeat() -> None:
    """Stop this process's heartbeat and wait for its thread (Note [collective watchdog]).
    Safe to call any number of times; the next collective starts a new one if a process group
    is initialized again."""
    hb, _local.heartbeat = _local.heartbeat, None
    if hb is not None and hb.pid == os.getpid():
        hb.stop()


atexit.register(stop_heartbeat)


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


def diagnose(name: str, ranks: list[int], count: int, wait_s: float = 2.5 * HEARTBEAT_S,
             point_to_point: bool = False) -> str:
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
        elif point_to_point and b["current"].get("p2p") and b["current"]["ranks"] == ranks:
            # Ranks of a pipeline issue different numbers of sends and receives: no order to compare.
            lines.append(f"rank {r}: alive and in point-to-point traffic of this group ({_where(b)})")
        elif b["current"]["ranks"] != ranks:
            # in a collective of another group: held up there by a rank of that group (a hung or
            # dead rank elsewhere), not out of order - each group's own order is compared apart
            # (review finding, helper-76: tp2 x dp2 with one rank hung blamed the order)
            lines.append(f"rank {r}: alive but {_where(b)}, another group's - it is waiting there (look at that "
                         "group's ranks above or in their own errors)")
        elif (b["current"]["name"], b["current"]["count"]) != (name, count):
            lines.append(f"rank {r}: alive but {_where(b)} - the ranks disagree on the order of collectives")
        else:
            lines.append(f"rank {r}: alive and in this same collective")
    return "; ".join(lines)


@contextlib.contextmanager
def collective(name: str, group=None, point_to_point: bool = False):
    """Record that this rank is in collective `name` of `group` while the block runs; turn a
    failure into a CollectiveError that says where each peer is (Note [collective watchdog]).
    Point-to-point operations (pipeline sends and receives, whose number differs by rank) are
    counted apart from the group's collectives, so they do not shift the order compared."""
    if not dist.is_initialized():
        yield
        return
    _ensure_heartbeat()
    ranks = _ranks(group)
    key = ("p2p " if point_to_point else "") + ",".join(map(str, ranks))
    count = _local.counts[key] = _local.counts.get(key, 0) + 1
    outer = _local.current
    _local.current = {"name": name, "ranks": ranks, "count": count, "since": time.time(), "p2p": point_to_point}
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo / NCCL errors and timeouts
        raise CollectiveError(f"{name} #{count} of group {ranks} failed on rank {dist.get_rank()} after "
                              f"{time.time() - _local.current['since']:.1f} s: "
                              f"{diagnose(name, ranks, count, point_to_point=point_to_point)}. "
                              f"Cause: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                              f"{_flight_recorder_hint(group)}") from e
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


def wait(work, name: str, group=None, point_to_point: bool = False) -> None:
    """Wait for an async collective's work handle under `collective()`."""
    if work is None:
        return
    with collective(name, group, point_to_point):
        work.wait()
