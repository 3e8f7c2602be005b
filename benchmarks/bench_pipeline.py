"""Pipeline schedules: measured bubble against (p - 1) / (m + p - 1), and 1F1B's activation memory.

    python benchmarks/bench_pipeline.py [--forward-ms 8] [--reps 5]

Stages are balanced and their compute is made measurable by *simulated* kernels: each stage
sleeps `forward_ms` in forward and twice that in backward (per microbatch and rank; an
interleaved rank's v chunks split it). On this 2-core machine p real compute-bound stages
would take turns on the cores and hide the bubble; sleeping stages overlap the way devices
do, while the schedule, the messages between stages (gloo) and autograd are the real ones.

Bubble fraction = the share of a step a rank is idle: 1 - busy / step time, busy = the time
it runs its schedule minus the time it is blocked on a receive (PipelineParallel.last_step_
times), averaged over ranks, median of `reps` steps. Idle time includes message latency and
the step's fixed collectives. The JSON also has the nominal bubble, 1 - m * (forward +
backward) / step time, which charges every per-microbatch overhead (Python, autograd,
posting messages: ~2 ms per microbatch here) to the bubble too. Theory: (p - 1) / (m + p - 1)
for gpipe and 1f1b, (p - 1) / (v m + p - 1) for interleaved (Megatron's (p - 1) / (v m)
bubble-to-compute ratio as a fraction of the step).
Memory: each stage keeps a `act_kib` activation per microbatch until its backward; the
bytes alive on stage 0 are tracked by the tensors' own lifetimes (weakref finalizers), peak
per step. Writes benchmarks/results/bench_pipeline.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, write_json  # noqa: E402

_live = {"bytes": 0, "peak": 0}


def _track(t: torch.Tensor) -> None:
    n = t.numel() * t.element_size()
    _live["bytes"] += n
    _live["peak"] = max(_live["peak"], _live["bytes"])
    weakref.finalize(t, lambda: _live.__setitem__("bytes", _live["bytes"] - n))


class _Kernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, act_numel):
        time.sleep(forward_s)
        ctx.act = torch.empty(act_numel)  # what a real layer would save for backward
        _track(ctx.act)
        ctx.backward_s = 2 * forward_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        del ctx.act
        return grad, None, None


class SimulatedStage(nn.Module):
    def __init__(self, forward_s: float, act_numel: int):
        super().__init__()
        self.forward_s, self.act_numel = forward_s, act_numel
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Kernel.apply(x * self.scale, self.forward_s, self.act_numel)


def theory(schedule: str, p: int, m: int, v: int) -> float:
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def _rank(rank, world, configs, forward_ms, act_kib, reps):
    p = world
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    rows = []
    for schedule, m in configs:
        v = 2 if schedule == "interleaved" else 1
        layers = [SimulatedStage(forward_ms / 1e3 / v, act_kib * 256) for _ in range(p * v)]
        pipe = PipelineParallel(PipelineStages(layers, virtual=v), schedule=schedule, microbatches=m,
                                loss_fn=lambda y, t: (y - t).pow(2).mean())
        x, y = torch.randn(m, 16), torch.randn(m, 16)
        times, waits, peaks = [], [], []
        for i in range(reps + 1):
            _live["peak"] = _live["bytes"]
            start = time.perf_counter()
            pipe.step(x, y)
            if i:  # the first step is a warm-up (thread pools, connections)
                times.append(time.perf_counter() - start)
                t = pipe.last_step_times
                waits.append(1 - (t["schedule_s"] - t["waiting_s"]) / times[-1])
                peaks.append(_live["peak"])
        rows.append({"schedule": schedule, "p": p, "m": m, "v": v, "step_s": statistics.median(times),
                     "idle_fraction": statistics.median(waits), "peak_activation_bytes": max(peaks)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forward-ms", type=float, default=8.0, help="simulated forward per microbatch and stage")
    ap.add_argument("--act-kib", type=int, default=256, help="activation kept per microbatch and stage")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    args = ap.parse_args(argv)
    f = args.forward_ms / 1e3
    results = []
    print(f"{'schedule':12s} {'p':>2s} {'m':>3s} {'v':>2s} {'step ms':>8s} {'bubble':>7s} {'theory':>7s} "
          f"{'measured/theory':>15s} {'nominal':>8s} {'stage-0 peak act (KiB)':>23s}")
    for p in args.stages:
        configs = [(s, m) for s in ("gpipe", "1f1b", "interleaved") for m in (p, 2 * p, 4 * p)]
        per_rank = spawn(_rank, p, (configs, args.forward_ms, args.act_kib, args.reps))
        for i, row in enumerate(per_rank[0]):
            step = max(r[i]["step_s"] for r in per_rank)  # the step ends when the last rank's does
            bubble = statistics.mean(r[i]["idle_fraction"] for r in per_rank)
            expected = theory(row["schedule"], p, row["m"], row["v"])
            row.update(step_s=step, bubble=bubble, nominal_bubble=1 - row["m"] * 3 * f / step, theory=expected,
                       ratio=bubble / expected)
            results.append(row)
            print(f"{row['schedule']:12s} {p:2d} {row['m']:3d} {row['v']:2d} {step * 1e3:8.1f} {bubble:7.3f} "
                  f"{expected:7.3f} {row['ratio']:15.2f} {row['nominal_bubble']:8.3f} "
                  f"{row['peak_activation_bytes'] / 1024:23.0f}")
    within = [abs(r["ratio"] - 1) <= 0.2 for r in results]
    print(f"bubble within 20% of theory: {sum(within)} of {len(within)} configurations")
    for p in args.stages:
        for s in ("gpipe", "1f1b"):
            peaks = {r["m"]: r["peak_activation_bytes"] // 1024 for r in results if r["p"] == p and r["schedule"] == s}
            print(f"stage-0 peak activations, {s:5s} p={p}: " + ", ".join(f"m={m}: {k} KiB" for m, k in peaks.items()))
    path = write_json("bench_pipeline", {"benchmark": "pipeline", "machine": machine(), "args": vars(args),
                                         "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
