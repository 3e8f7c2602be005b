"""Shared by the benchmark scripts: interleaved timing, machine description, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

import parallel_layers

# BENCH_RESULTS_DIR redirects every script's output (run_all.py --out, the smoke test).
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2,
                     sync: Callable[[], None] = lambda: None, shuffle: bool = False,
                     calls: int = 1, host: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds per call of each function, the functions run round-robin.

    Round-robin (one call of each per round) rather than one function at a time, so that a
    slow phase of a shared machine hits every variant alike and the ratios stay fair.
    shuffle: each round in its own order (seeded), so that no variant always follows the same
    one, whose caches and allocator state it would inherit every time: with three variants over
    one model's weights, the one always running after its sibling read ~2% faster at a small
    size on CPU; with linear_swiglu's four variants at 1024x2048x5632 in bfloat16, ours always
    after the bare GEMM read eager / ours 0.999 where shuffled rounds read 1.021 (the two alone,
    1.037). The single-process kernel benchmarks shuffle.
    calls: how many calls one sample makes between two syncs (the sample's time divided by it).
    With 1 (the default) a sample is one call's latency: on a GPU the host's time to reach the
    first kernel launch adds to the kernels'. With more, the launches queue behind the running
    kernels, as in a training loop, and a sample is the steady rate, ~max(host, GPU) time per
    call (`queued_calls`): the GPU's cost only where the GPU is the bottleneck.
    host: if given, filled with each function's median host time per call (until its last call
    returned, before the sync): a queued time close to it means the host was the bottleneck.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    issue: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns.items()), random.Random(0)
    for _ in range(reps):
        if shuffle:
            rng.shuffle(order)
        for name, fn in order:
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            sync()
            times[name].append((time.perf_counter() - start) / calls)
            issue[name].append((issued - start) / calls)
    if host is not None:
        host.update({name: statistics.median(ts) for name, ts in issue.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def queued_calls(per_call_s: dict[str, float], sample_s: float = 2e-3, most: int = 20) -> int:
    """Calls per sample for `time_interleaved(..., calls=)`'s throughput timing on a GPU: enough
    that the fastest variant's sample lasts ~sample_s, at most `most`, at least 1 (at sizes where
    one call already takes that long, the host's share is negligible and latency is throughput)."""
    fastest = min(per_call_s.values())
    return max(1, min(most, round(sample_s / fastest))) if fastest > 0 else most


def time_queued(fns: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None],
                latency: dict[str, float], shuffle: bool = False) -> dict:
    """fns timed queued, `queued_calls(latency)` calls per sample: {"calls", "s" (seconds per
    call), "host_s" (the host's share per call; None when calls is 1)}. latency: the same fns'
    one-call timings, returned as they are when that is 1 call (one call then lasts >= ~1.3 ms,
    next to which the host's ~10-100 us per call is small). shuffle: as time_interleaved's."""
    calls = queued_calls(latency)
    if calls == 1:
        return {"calls": 1, "s": latency, "host_s": None}
    host: dict[str, float] = {}
    return {"calls": calls, "host_s": host,
            "s": time_interleaved(fns, reps, sync=sync, shuffle=shuffle, calls=calls, host=host)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    except OSError:
        pass
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            # The same model name covers different VMs (an AVX2-only EPYC and a Zen 4 one): the
            # vector extensions that decide which GEMM code runs, and torch's own dispatch level.
            "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "torch": torch.__version__,
            # False on AVX2-only CPUs: our CPU bfloat16 GEMMs widen to float32 there (docs/kernels.md)
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            # where our fused ops' float32 CPU GEMMs run (Note [float32 GEMMs through oneDNN], csrc/gemm.cpp)
            "fp32_cpu_gemm": parallel_layers._C._fp32_cpu_gemm()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info.update(_code_version())
    return info


def _code_version() -> dict:
    """The commit the benchmark ran at and whether the tree had uncommitted changes, so that a
    results file says which code it measured (review finding, helper-72); {} outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": bool(dirty)}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def spawn(fn, world_size: int, args: tuple = ()) -> list:
    """Run fn(rank, world_size, *args) in `world_size` processes on gloo; return rank results.

    A small launcher for the distributed benchmarks (tests use tests/dist_harness.py, which
    also turns hangs and dead ranks into failures).
    """
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(fn, r, world_size, args, f"file://{tmp}/rdzv", queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
        failed = {r: v for r, v in results.items() if isinstance(v, BaseException)}
        if failed:
            raise RuntimeError(f"benchmark ranks failed: {failed}")
        return [results[r] for r in range(world_size)]


def _spawned(fn, rank, world_size, args, init_method, queue):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        queue.put((rank, fn(rank, world_size, *args)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put((rank, RuntimeError(f"rank {rank}: {e!r}")))


def queued_entry(forward: dict, forward_backward: dict, ratios: dict[str, float]) -> dict:
    """A GPU benchmark row's "queued" entry from two `time_queued` results and their ratios."""
    return {"forward_calls": forward["calls"], "forward_s": forward["s"], "forward_host_s": forward["host_s"],
            "forward_backward_calls": forward_backward["calls"], "forward_backward_s": forward_backward["s"],
            "forward_backward_host_s": forward_backward["host_s"], "ratios": ratios}


def host_bound_note(entry: dict, variants: tuple[str, ...], share: float = 0.9) -> str:
    """Which of `variants` were host-bound when queued (their host time per call >= share of the
    queued time): there the queued time is the host's, not the GPU's."""
    bound = [f"{phase} {name}" for phase, key in (("fwd", "forward"), ("f+b", "forward_backward"))
             if entry[f"{key}_host_s"] for name in variants
             if entry[f"{key}_host_s"][name] >= share * entry[f"{key}_s"][name]]
    return f"; host-bound: {', '.join(bound)}" if bound else ""

