"""Weak scaling: the GPT's training step at world sizes 1, 2, 4 with a fixed batch per rank.

    python benchmarks/bench_scaling.py [--worlds 1 2 4] [--batch-per-rank 8] [--reps 8]

Each world size trains parallel_layers.models.GPT data-parallel (our DataParallel, gloo) with
`batch-per-rank` sequences per rank, one thread per rank; step = forward, backward with the
bucketed all-reduce, AdamW. Efficiency = step time at world 1 / step time at world N (1.0 is
perfect weak scaling). On a machine with fewer cores than ranks the ranks share cores, and
the efficiency says so: compare it with the core count in the report. Writes
benchmarks/results/bench_scaling.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, write_json  # noqa: E402


def _rank(rank, world, batch, seq, d_model, layers, reps):
    from parallel_layers import DataParallel
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq_len=seq, d_model=d_model, heads=4, layers=layers))
    wrapped = DataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        model.loss(wrapped(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up: allocator, bucket rebuild after the first backward
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args(argv)
    rows = []
    for world in args.worlds:
        per_rank = spawn(_rank, world, (args.batch_per_rank, args.seq, args.d_model, args.layers, args.reps))
        step = max(per_rank)
        tokens = world * args.batch_per_rank * args.seq / step
        rows.append({"world": world, "step_s": step, "tokens_per_s": tokens})
    for r in rows:
        r["efficiency"] = rows[0]["step_s"] / r["step_s"] if rows[0]["world"] == 1 else None
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        print(f"world {r['world']}: {r['step_s'] * 1e3:7.1f} ms/step, {r['tokens_per_s']:8.0f} tokens/s, "
              f"weak-scaling efficiency {eff}")
    print(f"({os.cpu_count()} cores on this machine; ranks beyond that share them)")
    path = write_json("bench_scaling", {"benchmark": "scaling", "machine": machine(), "args": vars(args),
                                        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
