"""Activation checkpointing (none / selective / full): activation memory per rank and step time.

    python benchmarks/bench_activation_checkpointing.py [--layouts tp2 zero3] [--layers 4] [--d-model 256]
                                                        [--seq 256] [--batch 8] [--reps 5]

The reference GPT (parallel_layers.models, float32) through `parallelize(...,
activation_checkpointing=mode)` at tp=2 (GPT_TP_PLAN) and at dp=2 with ZeRO-3 (blocks as ZeRO's
groups), 2 processes on gloo, one thread each. In each layout the three modes are three models
in the same processes, so their ratios share the machine's state:

- saved bytes: the distinct storages autograd keeps for backward at the end of the forward,
  per rank - every tensor packed through a saved_tensors_hooks around the forward (what
  "selective" keeps included: checkpoint(respect_saved_tensors_hooks=True)) plus, with
  checkpointing, the blocks' inputs that checkpoint holds for the recompute. Exact, and
  independent of the allocator.
- peak RSS: the most resident memory during a forward + backward (sampled every millisecond by
  a thread) minus the resident memory before it; glibc returns every allocation of 64 KiB or
  more to the system when freed (MALLOC_MMAP_THRESHOLD_), so this follows live tensors. It adds
  to the saved bytes the backward's transients (the recompute of one block, gradients).
- step time: forward + backward + SGD step, median of --reps, the modes interleaved round-robin.

Writes benchmarks/results/bench_activation_checkpointing.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, time_interleaved, write_json  # noqa: E402

MODES = (None, "selective", "full")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _PeakRSS:
    """The highest resident set seen while the block runs, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss_bytes()
        self.stop = threading.Event()

        def sample():
            while not self.stop.is_set():
                self.peak = max(self.peak, _rss_bytes())
                time.sleep(0.001)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _run(rank, world, layout, cfg_kwargs, batch, reps):
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.models import GPT, GPT_TP_PLAN, Block, GPTConfig

    ctx = init_parallel(tp=2, device="cpu") if layout == "tp2" else init_parallel(dp=2, device="cpu")
    cfg = GPTConfig(**cfg_kwargs)
    g = torch.Generator().manual_seed(1 + ctx.coordinate("dp"))
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    runs = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPT(cfg)
        par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), loss_fn=model.loss,
                          tp_plan=GPT_TP_PLAN, activation_checkpointing=mode,
                          zero_stage=3 if layout == "zero3" else 0, wrap=lambda m: isinstance(m, Block))
        blocks = [m for m in model.modules() if isinstance(m, Block)]

        def step(par=par):
            par.forward_backward(inputs, targets)
            par.step()
            par.zero_grad()

        runs[mode] = (par, blocks, step)

    saved, rss, losses = {}, {}, {}
    for mode, (par, blocks, step) in runs.items():
        step()  # the first step allocates what every later step reuses (gradients, ZeRO buffers)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def held_input(module, args, kwargs):  # checkpoint holds the block's inputs for the recompute
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        handles = [b.register_forward_pre_hook(held_input, with_kwargs=True) for b in blocks] if mode else []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = par.loss_fn(par.module(inputs), targets)
        for h in handles:
            h.remove()
        saved[mode] = sum(storages.values())
        loss.backward()
        par.zero_grad()
        del loss
        with _PeakRSS() as peak:
            loss = par.forward_backward(inputs, targets)
        par.zero_grad()
        rss[mode] = peak.peak - peak.base
        losses[mode] = loss.item()
    times = time_interleaved({str(mode): step for mode, (_, _, step) in runs.items()}, reps)
    return {"saved_bytes": {str(m): v for m, v in saved.items()}, "peak_rss_bytes": {str(m): v for m, v in rss.items()},
            "step_s": times, "loss": {str(m): v for m, v in losses.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["tp2", "zero3"], choices=["tp2", "zero3"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    # Allocations of 64 KiB and more are mmap'd and returned when freed (glibc otherwise raises
    # the threshold as it goes and keeps freed memory): the spawned ranks inherit it.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    cfg = dict(vocab=args.vocab, seq_len=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers,
               qkv_bias=False)
    results, ratios = {}, {}
    for layout in args.layouts:
        ranks = spawn(_run, 2, (layout, cfg, args.batch, args.reps))
        # per rank -> the largest rank's value (the ranks of one layout hold the same shapes)
        merged = {key: {m: max(r[key][m] for r in ranks) for m in ranks[0][key]} for key in ranks[0] if key != "loss"}
        merged["loss"] = ranks[0]["loss"]
        results[layout] = merged
        ratios[layout] = {f"{m}_over_none": {key: merged[key][m] / merged[key]["None"]
                                             for key in ("saved_bytes", "peak_rss_bytes", "step_s")}
                          for m in ("selective", "full")}
        for m in ("None", "selective", "full"):
            print(f"{layout:5s} {m:9s} saved {merged['saved_bytes'][m] / 2**20:7.1f} MiB  peak RSS "
                  f"{merged['peak_rss_bytes'][m] / 2**20:7.1f} MiB  step {merged['step_s'][m] * 1e3:7.1f} ms  "
                  f"loss {merged['loss'][m]:.6f}")
        for m in ("selective", "full"):
            r = ratios[layout][f"{m}_over_none"]
            print(f"{layout:5s} {m} / none: saved bytes {r['saved_bytes']:.2f}, peak RSS {r['peak_rss_bytes']:.2f}, "
                  f"step time {r['step_s']:.2f}")
    path = write_json("bench_activation_checkpointing", {
        "benchmark": "activation_checkpointing", "machine": machine(), "args": vars(args),
        "memory": "saved_bytes: distinct storages kept for backward at the end of forward, per rank (max over "
                  "ranks); peak_rss_bytes: peak resident set during forward + backward minus the one before it",
        "results": results, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
