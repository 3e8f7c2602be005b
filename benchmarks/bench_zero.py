"""ZeRO-3 vs PyTorch FSDP2 (fully_shard) vs DDP: step time and peak per-rank memory.

    python benchmarks/bench_zero.py [--world 2] [--layers 4] [--d-model 512] [--reps 10]

Same model (an MLP stack of --layers blocks d -> 4d -> d), same data, world size 2 on gloo,
one thread per rank, each variant in fresh processes. Step = forward + backward + AdamW step. Memory is the peak resident
set of each rank's process during the timed steps minus its resident set before the model
was built (CPU has no allocator statistics), so it counts params, grads, optimizer state and
activations alike for every variant. Writes benchmarks/results/bench_zero.json.
Target: ZeRO-3 step time <= 1.0x FSDP2's, memory no higher.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, time_interleaved, write_json  # noqa: E402


def _model(layers: int, d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _run_variant(rank, ws, kind, layers, d, tokens, reps):
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_layers import ZeRO

    base = _rss_bytes()
    model = _model(layers, d)
    if kind == "zero3":
        zero = ZeRO(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=3)
        fwd, opt_step, zero_grad = zero, zero.step, zero.zero_grad
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd, opt_step, zero_grad = model, opt.step, lambda: opt.zero_grad(set_to_none=True)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        fwd, opt_step, zero_grad = ddp, opt.step, lambda: opt.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)
    peak = [0]

    def step():
        F.mse_loss(fwd(x), y).backward()
        peak[0] = max(peak[0], _rss_bytes())
        opt_step()
        zero_grad()
        peak[0] = max(peak[0], _rss_bytes())

    t = time_interleaved({kind: step}, reps)[kind]
    return t, peak[0] - base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    params = sum(p.numel() for p in _model(args.layers, args.d_model).parameters())
    summary = {}
    for kind in ("zero3", "fsdp2", "ddp"):
        # Fresh processes per variant, so no variant reuses memory another one left behind.
        results = spawn(_run_variant, args.world, (kind, args.layers, args.d_model, args.tokens, args.reps))
        times = [r[0] for r in results]
        mems = [r[1] for r in results]
        summary[kind] = {"step_s": max(times), "peak_rss_bytes_max_rank": max(mems)}
        print(f"{kind:6s} step {max(times) * 1e3:8.2f} ms   peak memory per rank {max(mems) / 2**20:8.1f} MiB")
    ratios = {"zero3_over_fsdp2_time": summary["zero3"]["step_s"] / summary["fsdp2"]["step_s"],
              "zero3_over_fsdp2_memory": summary["zero3"]["peak_rss_bytes_max_rank"]
              / summary["fsdp2"]["peak_rss_bytes_max_rank"],
              "zero3_over_ddp_time": summary["zero3"]["step_s"] / summary["ddp"]["step_s"]}
    print(f"{params / 1e6:.1f}M params, world {args.world}: ZeRO-3 / FSDP2 time {ratios['zero3_over_fsdp2_time']:.2f} "
          f"(target <= 1.0), memory {ratios['zero3_over_fsdp2_memory']:.2f} (target <= 1.0); "
          f"ZeRO-3 / DDP time {ratios['zero3_over_ddp_time']:.2f}")
    path = write_json("bench_zero", {"benchmark": "zero", "machine": machine(), "args": vars(args),
                                     "params": params, "results": summary, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
