"""Per-call host time of the fused ops against eager, at sizes where the arithmetic is nothing.

    python benchmarks/bench_op_overhead.py [--device cpu|cuda] [--reps 15] [--calls 200]

What a call costs besides its kernels - dispatch, autograd bookkeeping, allocations, argument
checks - is what a GPU waits on when a model's layers are small, and what decides whether a
fused op beats eager's two or three native ops at ordinary sizes (on an H200 a bfloat16
linear_gelu forward + backward at 2048 x 1024 -> 4096 had ~0.12 ms of GPU work and took 0.72 ms
of wall clock: benchmarks/results/2026-11-26-h200.md). For linear_gelu, linear_swiglu and
rms_norm against their eager forms (F.gelu(F.linear), F.silu(gate) * up of one F.linear,
Hugging Face's LlamaRMSNorm arithmetic) on x [4, 8] it times, interleaved, --calls calls in a
row: forward without grad, forward with grad, forward + backward (torch.autograd.grad). On CPU
the float32 GEMMs go through ATen (_set_cpu_gemm("aten")): oneDNN's per-call setup for a
4 x 8 GEMM would be timed otherwise, which is not what a GPU sees. Prints microseconds per call
and eager / ours; writes benchmarks/results/bench_op_overhead.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, time_interleaved, write_json  # noqa: E402

import parallel_layers  # noqa: E402
from parallel_layers import _C  # noqa: E402
from parallel_layers.ops import linear_gelu, linear_swiglu, rms_norm  # noqa: E402


def cases(device: str) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)

    def param(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    x, w, b, w2, nw = param(4, 8), param(8, 8), param(8), param(16, 8), param(8)
    dy = torch.randn(4, 8, generator=g).to(device)

    def eager_swiglu():
        gate, up = F.linear(x, w2).chunk(2, dim=-1)
        return F.silu(gate) * up

    def eager_rms_norm():
        x32 = x.float()
        return nw * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    return {
        "linear_gelu": (lambda: linear_gelu(x, w, b), lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                        (x, w, b), dy),
        "linear_swiglu": (lambda: linear_swiglu(x, w2), eager_swiglu, (x, w2), dy),
        "rms_norm": (lambda: rms_norm(x, nw, 1e-6), eager_rms_norm, (x, nw), dy),
    }


def repeat(fn, calls: int, grad_mode: bool, backward=None):
    def run():
        with torch.set_grad_enabled(grad_mode):
            for _ in range(calls):
                y = fn()
                if backward is not None:
                    torch.autograd.grad(y, backward[0], backward[1])
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    ap.add_argument("--name", default="bench_op_overhead", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        _C._set_cpu_gemm("aten")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    rows = []
    print(f"{'op':>14} | {'us/call: fwd no-grad ours':>25} {'eager':>7} | {'fwd grad ours':>13} {'eager':>7} | "
          f"{'fwd+bwd ours':>12} {'eager':>7} | eager/ours: no-grad, grad, fwd+bwd")
    for name, (ours, eager, inputs, dy) in cases(args.device).items():
        fns = {}
        for label, fn in (("ours", ours), ("eager", eager)):
            fns[f"nograd_{label}"] = repeat(fn, args.calls, False)
            fns[f"grad_{label}"] = repeat(fn, args.calls, True)
            fns[f"train_{label}"] = repeat(fn, args.calls, True, (inputs, dy))
        t = {k: v / args.calls * 1e6 for k, v in time_interleaved(fns, args.reps, sync=sync).items()}
        r = {f"{mode}_eager_over_ours": t[f"{mode}_eager"] / t[f"{mode}_ours"] for mode in ("nograd", "grad", "train")}
        rows.append({"op": name, "device": args.device, "us_per_call": t, "ratios": r})
        print(f"{name:>14} | {t['nograd_ours']:25.1f} {t['nograd_eager']:7.1f} | {t['grad_ours']:13.1f} "
              f"{t['grad_eager']:7.1f} | {t['train_ours']:12.1f} {t['train_eager']:7.1f} | "
              f"{r['nograd_eager_over_ours']:.2f}, {r['grad_eager_over_ours']:.2f}, {r['train_eager_over_ours']:.2f}",
              flush=True)
    payload = {"benchmark": "op_overhead", "machine": machine(), "build": parallel_layers.build_info(),
               "reps": args.reps, "calls": args.calls, "rows": rows}
    print(f"wrote {write_json(args.name, payload)}")
    return rows


if __name__ == "__main__":
    main()
