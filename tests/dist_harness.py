"""Run a test function in N real processes joined in a torch.distributed process group.

    results = run_distributed(fn, world_size=4, args=(...,), timeout_s=120)

`fn(rank, world_size, *args)` runs in every rank (a module-level function, so it can be
pickled) after `init_process_group` (gloo by default); its return values come back as a
list indexed by rank. The run fails, never hangs:
- an exception in any rank raises DistributedTestFailure carrying that rank's traceback;
- a rank that dies (signal, os._exit) fails the run as soon as it is seen, naming the rank;
- ranks still running after `timeout_s` are killed and the run fails, naming them;
- a collective that never completes raises inside its rank after `collective_timeout_s`
  (the process group's own timeout), which then fails the run as above.
Workers start from a forkserver that has imported torch, the library and transformers' model
families once, so a run costs a fork, not a fresh interpreter and its imports per rank.

One failure is not the code under test: gloo's TCP rendezvous (`connectFullMesh`, run while a
process group is created) rarely sees a peer's half-open socket closed under load (seen once in
~60 runs of a 3-rank new_group on this 2-core machine). A run that fails only that way is
retried, at most `_RENDEZVOUS_RETRIES` times, with a warning; any other failure is reported.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

_POLL_S = 0.1
_GRACE_S = 2.0  # after a first failure, how long to collect the other ranks' reports
_RENDEZVOUS_RETRIES = 2
_RENDEZVOUS_FLAKE = "Gloo connectFullMesh failed"
_ctx = mp.get_context("forkserver")
# What the test functions import, loaded once into the forkserver so that no rank pays for it
# again: `from transformers import LlamaForCausalLM` alone costs ~3 s of CPU in a process that
# has torch, and the ranks of a run share 2 cores. With only torch preloaded, tests/hf +
# tests/tensor_parallel/test_parallelize.py took 101 s here, with this list 23 s, and the whole
# default pytest run 7.7 min. A module missing here is imported by the rank as before.
_ctx.set_forkserver_preload([
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor", "parallel_layers",
    "parallel_layers.hf", "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
])


class DistributedTestFailure(AssertionError):
    """A rank raised, died or hung; the message says which and why."""


def _worker(fn, rank, world_size, args, init_file, backend, collective_timeout_s, results):
    import torch
    import torch.distributed as dist

    # N ranks share this machine's cores: one intra-op thread each. The environment variable alone
    # does not do it here - the forkserver imported torch (and its OpenMP) before it was set.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without reporting a result"


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str = "gloo",
                    timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
                    may_die: tuple[int, ...] = ()) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the results by rank.

    Ranks in `may_die` are expected to kill themselves (fault tests): their death is not a
    failure and their result is None."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_RENDEZVOUS_RETRIES + 1):
        try:
            return _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, may_die)
        except DistributedTestFailure as e:
            if _RENDEZVOUS_FLAKE not in str(e) or attempt == _RENDEZVOUS_RETRIES:
                raise
            warnings.warn(f"gloo rendezvous failed while creating a process group (attempt {attempt + 1}); "
                          f"running {fn.__name__} again:\n{e}", RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable")


def _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, may_die) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = _ctx.Queue()
        procs = [_ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                              args=(fn, r, world_size, args, init_file, backend, collective_timeout_s, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout_s, may_die)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _collect(procs, results, timeout_s: float, may_die: tuple[int, ...] = ()) -> list[Any]:
    """Wait for every rank's result; on the first failure, gather the others' for a moment.

    A dead rank usually makes its peers raise too (gloo sees the reset connection), so the
    report lists dead ranks first (the likely cause), then the ranks that raised.
    """
    world_size = len(procs)
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    report_at = None  # set once something failed: when to stop gathering and report
    while len(done) + len(errors) < world_size:
        now = time.monotonic()
        if report_at is not None and now > report_at:
            break
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(done) - set(errors))
            errors.setdefault(-1, f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                                  "(hung?); killed them")
            break
        try:
            rank, status, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            pass
        else:
            if status == "error":
                errors[rank] = f"rank {rank} of {world_size} raised:\n{payload}"
            else:
                done[rank] = payload
        for rank, p in enumerate(procs):
            # A dead process may still have a result in flight: only judge it on an empty queue.
            if rank not in done and rank not in errors and not p.is_alive() and results.empty():
                if rank in may_die:
                    done[rank] = None
                else:
                    errors[rank] = f"rank {rank} of {world_size} {_describe_exit(p.exitcode)}"
        if errors and report_at is None:
            report_at = time.monotonic() + _GRACE_S
    if errors:
        died = [m for r, m in sorted(errors.items()) if "raised:" not in m]
        raised = [m for r, m in sorted(errors.items()) if "raised:" in m]
        raise DistributedTestFailure("\n".join(died + raised))
    return [done[r] for r in range(world_size)]
