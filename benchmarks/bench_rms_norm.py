"""Fused RMSNorm (`rms_norm`, `rms_norm_add`) against Hugging Face's LlamaRMSNorm module.

    python benchmarks/bench_rms_norm.py [--device cpu|cuda] [--reps 25] [--quick]

For rows x hidden (tokens x model width) and float32 / bfloat16 it times, interleaved in one run
(median of --reps calls after warm-up; each round in a shuffled order, _common.time_interleaved):
  forward (no grad):  ours | LlamaRMSNorm eager | a copy of the input (the memory-traffic floor)
  forward + backward: ours | LlamaRMSNorm eager
each without and with the residual add (eager: `residual + x`, then the module). The copy
reads and writes the tensor once; the norm reads it and writes its output once too, so ours /
copy is how far the forward is from the bandwidth limit. Prints a table of ratios and writes
benchmarks/results/bench_rms_norm.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, time_interleaved, write_json  # noqa: E402

import parallel_layers  # noqa: E402
from parallel_layers.ops import FusedRMSNorm  # noqa: E402

SHAPES = [(rows, hidden) for rows in (512, 4096) for hidden in (512, 1024, 4096)]
QUICK_SHAPES = [(64, 256)]
EPS = 1e-6


def bench_case(rows, hidden, dtype, device, reps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    res = torch.randn(rows, hidden, generator=g).to(device, dtype)
    dy = torch.randn(rows, hidden, generator=g).to(device, dtype)
    hf = LlamaRMSNorm(hidden, eps=EPS).to(device, dtype)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.1, generator=torch.Generator(device).manual_seed(1))
    ours = FusedRMSNorm.from_hf(hf)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    with torch.no_grad():
        t_fwd = time_interleaved({
            "ours": lambda: ours(x),
            "hf": lambda: hf(x),
            "ours_add": lambda: ours(x, res),
            "hf_add": lambda: hf(res + x),
            "copy": lambda: x.clone(),
        }, reps, sync=sync, shuffle=True)

    xg, rg = x.clone().requires_grad_(), res.clone().requires_grad_()
    params = (xg, hf.weight)

    def train(fn, add):
        def run():
            inputs = (xg, rg, hf.weight) if add else params
            out = fn()
            if add:  # both outputs of the add flow on: the norm to the layer, the sum to the next residual
                y, s = out
                torch.autograd.grad((y, s), inputs, (dy, dy))
            else:
                torch.autograd.grad(out, inputs, dy)
        return run

    def hf_add():
        s = rg + xg
        return hf(s), s

    t_train = time_interleaved({
        "ours": train(lambda: ours(xg), add=False),
        "hf": train(lambda: hf(xg), add=False),
        "ours_add": train(lambda: ours(xg, rg), add=True),
        "hf_add": train(hf_add, add=True),
    }, reps, sync=sync, shuffle=True)
    return t_fwd, t_train


def ratios(t_fwd, t_train) -> dict:
    return {
        "fwd_hf_over_ours": t_fwd["hf"] / t_fwd["ours"],
        "fwd_add_hf_over_ours": t_fwd["hf_add"] / t_fwd["ours_add"],
        "fwd_ours_over_copy": t_fwd["ours"] / t_fwd["copy"],
        "train_hf_over_ours": t_train["hf"] / t_train["ours"],
        "train_add_hf_over_ours": t_train["hf_add"] / t_train["ours_add"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    ap.add_argument("--name", default="bench_rms_norm", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)

    rows_out = []
    load_before = os.getloadavg()  # the machine may be shared: the ratios hold, the times less so
    print(f"load average {load_before[0]:.2f} (1 min) on {os.cpu_count()} cores")
    print(f"{'rows x hidden':>14} {'dtype':>9} | {'fwd ms: ours':>12} {'hf':>7} {'copy':>7} | {'hf/ours':>7} "
          f"{'+add':>6} {'ours/copy':>9} | {'f+b ms: ours':>12} {'hf':>7} | {'hf/ours':>7} {'+add':>6}")
    for rows, hidden in QUICK_SHAPES if args.quick else SHAPES:
        for dname in args.dtypes.split(","):
            t_fwd, t_train = bench_case(rows, hidden, getattr(torch, dname), args.device, args.reps)
            r = ratios(t_fwd, t_train)
            rows_out.append({"rows": rows, "hidden": hidden, "dtype": dname, "device": args.device,
                             "forward_s": t_fwd, "forward_backward_s": t_train, "ratios": r})
            ms = lambda t: f"{t * 1e3:7.3f}"  # noqa: E731
            print(f"{f'{rows} x {hidden}':>14} {dname:>9} | {ms(t_fwd['ours']):>12} {ms(t_fwd['hf'])} "
                  f"{ms(t_fwd['copy'])} | {r['fwd_hf_over_ours']:7.2f} {r['fwd_add_hf_over_ours']:6.2f} "
                  f"{r['fwd_ours_over_copy']:9.2f} | {ms(t_train['ours']):>12} {ms(t_train['hf'])} | "
                  f"{r['train_hf_over_ours']:7.2f} {r['train_add_hf_over_ours']:6.2f}", flush=True)
    payload = {"benchmark": "rms_norm", "machine": machine(), "build": parallel_layers.build_info(),
               "reps": args.reps, "load_average_before_after": [load_before[0], os.getloadavg()[0]],
               "rows": rows_out}
    path = write_json(args.name, payload)
    print(f"wrote {path}")
    return rows_out


if __name__ == "__main__":
    main()
