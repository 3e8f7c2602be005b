"""DataParallel vs PyTorch DDP: step time, world size 2 on gloo, interleaved in one run.

    python benchmarks/bench_dp.py [--layers 4] [--d-model 512] [--tokens 512] [--reps 15]

Same model (an MLP stack), same data; step = forward + backward (with the bucketed
all-reduce) + AdamW step. Writes benchmarks/results/bench_dp.json. Target: ours <= 1.0x DDP.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, time_interleaved, write_json  # noqa: E402


def _rank(rank, ws, layers, d, tokens, reps):
    from parallel_layers import DataParallel

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)])
    models = {"ours": DataParallel(copy.deepcopy(net)), "ddp": nn.parallel.DistributedDataParallel(copy.deepcopy(net))}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)

    def step(name):
        def run():
            F.mse_loss(models[name](x), y).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        return run

    return time_interleaved({k: step(k) for k in models}, reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    results = spawn(_rank, 2, (args.layers, args.d_model, args.tokens, args.reps))
    t = {k: max(r[k] for r in results) for k in ("ours", "ddp")}
    ratio = t["ours"] / t["ddp"]
    print(f"world 2: ours {t['ours'] * 1e3:.2f} ms, DDP {t['ddp'] * 1e3:.2f} ms per step -> ours / DDP = {ratio:.2f} "
          "(target <= 1.0)")
    path = write_json("bench_dp", {"benchmark": "dp", "machine": machine(), "args": vars(args),
                                   "seconds_per_step": t, "ours_over_ddp": ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
