"""Fused linear + SwiGLU (`linear_swiglu`) against what a user would otherwise run.

    python benchmarks/bench_linear_swiglu.py [--device cpu|cuda] [--reps 15] [--quick] [--compile]
                                             [--shapes M,K,N ...] [--dtypes float32,bfloat16]

For Llama-style MLP shapes (tokens M, hidden K -> ffn N) and float32 / bfloat16 it times,
interleaved in one run (median of --reps calls after warm-up; each round in a shuffled order, so
that no variant always inherits the same predecessor's caches and allocator state:
_common.time_interleaved), forward without autograd and forward + backward:
  ours          linear_swiglu(x, W, b), W the packed [2N, K] weight
  eager         what a Hugging Face Llama MLP runs: F.silu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)
                with separate gate and up parameters
  eager packed  one F.linear on the packed weight, chunk, F.silu(gate) * up
  GEMM          F.linear on the packed weight alone: the bare packed GEMM, the practical limit of
                the forward (ours / GEMM = 1.0 is a free epilogue)
  compile       torch.compile of eager packed, with --compile
and, on CPU in float32, the same through oneDNN's matmul (ATen's mkldnn::_linear_pointwise), the
library our op's float32 GEMMs use on some CPUs (Note [float32 GEMMs through oneDNN], csrc/gemm.cpp;
`fp32_cpu_gemm` in the machine line says which):
  eager oneDNN  eager's two linears through oneDNN, F.silu, mul: the fusion's own gain, same GEMMs
  GEMM oneDNN   the bare packed GEMM through oneDNN
"ours / GEMM" is against the bare GEMM of the library our op used (ours_over_gemm), and ours over
ATen's GEMM is kept too (ours_over_aten_gemm).
On CUDA each variant is also timed queued: several calls between two syncs (`calls` in the
row's "queued" entry; enough for ~2 ms, at most 20), the launches waiting behind the running
kernels as in a training loop. The default samples are one call's latency, in which the host's
time to reach the first kernel adds to the GPU's. A queued sample is the steady rate, about the
larger of the host's and the GPU's time per call: the GPU's cost where the GPU is the bottleneck,
the host's where the host is. The host's time per call is kept too (`*_host_s`), and a variant
whose host time is >= 90% of its queued time is printed as host-bound. Both timings are kept;
neither replaces the other.
It also times the backward alone, without autograd (bwd_split_over_fused): the fused op
(linear_swiglu_backward: one elementwise pass that also writes the weight gradient's operand
layout, then dx and dW) against the same work split in three ops - swiglu_backward, then
linear_input_grad and linear_weight_grad on its d_preact - which is what the tensor-parallel
packed layer runs (it overlaps dx's collective with dW). Both give the same bits.
Prints a table of ratios and writes benchmarks/results/bench_linear_swiglu.json and .png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS, host_bound_note, machine, queued_entry, time_interleaved,  # noqa: E402
                     time_queued, write_json)

import parallel_layers  # noqa: E402
from parallel_layers.ops import linear_swiglu  # noqa: E402

# (M tokens, K hidden, N ffn): a small Llama at seq 256 x batch 2, a 1024-wide one, a 2048-wide one.
SHAPES = [(512, 512, 1376), (512, 1024, 2816), (1024, 2048, 5632)]
QUICK_SHAPES = [(64, 64, 96)]


def eager_separate(x, wg, bg, wu, bu):
    return F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu)


def eager_packed(x, w, b):
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    return F.silu(gate) * up


class _OneDNNLinear(torch.autograd.Function):
    """x @ w.T + b through oneDNN's matmul, forward and dx (as our op's rule does), dW from ATen."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.ops.mkldnn._linear_pointwise(g, w.t(), None, "none", [], ""), g.t() @ x, g.sum(0)


def eager_onednn(x, wg, bg, wu, bu):
    return F.silu(_OneDNNLinear.apply(x, wg, bg)) * _OneDNNLinear.apply(x, wu, bu)


def bench_case(m, k, n, dtype, device, reps, compile_baseline):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(device, dtype)
    b = torch.randn(2 * n, generator=g).to(device, dtype)
    wg, wu = w[:n].clone(), w[n:].clone()  # separate parameters, as a Llama MLP holds them
    bg, bu = b[:n].clone(), b[n:].clone()
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    dy_gemm = torch.randn(m, 2 * n, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch._dynamo.reset()  # a fresh recompile budget per case (see bench_linear_gelu.py)
    compiled = torch.compile(eager_packed) if compile_baseline else None

    fwd = {
        "ours": lambda: linear_swiglu(x, w, b),
        "eager": lambda: eager_separate(x, wg, bg, wu, bu),
        "eager_packed": lambda: eager_packed(x, w, b),
        "gemm": lambda: F.linear(x, w, b),
    }
    if compiled:
        fwd["compile"] = lambda: compiled(x, w, b)
    onednn = device == "cpu" and dtype == torch.float32
    if onednn:
        fwd["eager_onednn"] = lambda: eager_onednn(x, wg, bg, wu, bu)
        fwd["gemm_onednn"] = lambda: _OneDNNLinear.apply(x, w, b)
    queued = {}  # on CUDA: the same variants timed queued (the module doc)
    with torch.no_grad():
        t_fwd = time_interleaved(fwd, reps, sync=sync, shuffle=True)
        if device == "cuda":
            queued["forward"] = time_queued(fwd, reps, sync, t_fwd, shuffle=True)

    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    xg, w_, b_, wg_, bg_, wu_, bu_ = (leaf(t) for t in (x, w, b, wg, bg, wu, bu))

    def train(fn, inputs, grad):
        def run():
            torch.autograd.grad(fn(*inputs), inputs, grad)
        return run

    t_train = {
        "ours": train(linear_swiglu, (xg, w_, b_), dy),
        "eager": train(eager_separate, (xg, wg_, bg_, wu_, bu_), dy),
        "eager_packed": train(eager_packed, (xg, w_, b_), dy),
        "gemm": train(F.linear, (xg, w_, b_), dy_gemm),
    }
    if compiled:
        t_train["compile"] = train(compiled, (xg, w_, b_), dy)
    if onednn:
        t_train["eager_onednn"] = train(eager_onednn, (xg, wg_, bg_, wu_, bu_), dy)
        t_train["gemm_onednn"] = train(_OneDNNLinear.apply, (xg, w_, b_), dy_gemm)
    train_fns, t_train = t_train, time_interleaved(t_train, reps, sync=sync, shuffle=True)
    if device == "cuda":
        queued["forward_backward"] = time_queued(train_fns, reps, sync, t_train, shuffle=True)

    ops = torch.ops.parallel_layers
    preact = F.linear(x, w, b)

    def split():
        d_pre, db = ops.swiglu_backward(dy, preact, True)
        return ops.linear_input_grad(d_pre, w), ops.linear_weight_grad(d_pre, x), db

    fused = lambda: ops.linear_swiglu_backward(dy, x, w, preact, [True, True, True])  # noqa: E731
    assert all(torch.equal(a, c) for a, c in zip(fused(), split())), "fused and split backward differ"
    t_bwd = time_interleaved({"fused": fused, "split": split}, reps, sync=sync, shuffle=True)
    return t_fwd, t_train, t_bwd, queued


def gemm_library(dtype, device) -> str:
    """Where our op's GEMMs ran: oneDNN for float32 on CPU where the rule says so, else ATen's."""
    return parallel_layers._C._fp32_cpu_gemm() if device == "cpu" and dtype == torch.float32 else "aten"


def ratios(t_fwd, t_train, t_bwd, gemm_library: str) -> dict:
    r = {}
    r["bwd_split_over_fused"] = t_bwd["split"] / t_bwd["fused"]
    for phase, t in (("fwd", t_fwd), ("train", t_train)):
        r[f"{phase}_eager_over_ours"] = t["eager"] / t["ours"]
        r[f"{phase}_eager_packed_over_ours"] = t["eager_packed"] / t["ours"]
        own_gemm = t["gemm_onednn"] if gemm_library == "onednn" and "gemm_onednn" in t else t["gemm"]
        r[f"{phase}_ours_over_gemm"] = t["ours"] / own_gemm
        r[f"{phase}_ours_over_aten_gemm"] = t["ours"] / t["gemm"]
        if "eager_onednn" in t:
            r[f"{phase}_eager_onednn_over_ours"] = t["eager_onednn"] / t["ours"]
        if "compile" in t:
            r[f"{phase}_compile_over_ours"] = t["compile"] / t["ours"]
    return r


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['m']}x{r['k']}x{r['n']}\n{r['dtype']}" for r in rows]
    keys = [("fwd_eager_over_ours", "fwd: eager / ours"), ("fwd_eager_packed_over_ours", "fwd: eager packed / ours"),
            ("train_eager_over_ours", "fwd+bwd: eager / ours"), ("fwd_ours_over_gemm", "fwd: ours / packed GEMM")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r["ratios"][key] for r in rows], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.05, color="gray", linewidth=0.8, linestyle="--", label="1.05 (target for ours / GEMM, float32)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel("time ratio (>1: ours faster, except ours / GEMM)")
    ax.set_title(f"linear_swiglu on {rows[0]['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    ap.add_argument("--shapes", nargs="+", help="M,K,N triples instead of the default shapes")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of eager packed")
    ap.add_argument("--name", default="bench_linear_swiglu", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)

    rows = []
    print(f"{'M,K,N':>16} {'dtype':>9} | {'fwd ms: ours':>12} {'eager':>7} {'packed':>7} {'gemm':>7} | "
          f"{'eager/ours':>10} {'packed/ours':>11} {'ours/gemm':>9} | {'f+b ms: ours':>12} {'eager':>7} "
          f"{'packed':>7} {'gemm':>7} | {'eager/ours':>10} {'packed/ours':>11} {'ours/gemm':>9}")
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else \
        QUICK_SHAPES if args.quick else SHAPES
    for m, k, n in shapes:
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            t_fwd, t_train, t_bwd, queued = bench_case(m, k, n, dtype, args.device, args.reps, args.compile)
            library = gemm_library(dtype, args.device)
            r = ratios(t_fwd, t_train, t_bwd, library)
            rows.append({"m": m, "k": k, "n": n, "dtype": dname, "device": args.device, "gemm_library": library,
                         "forward_s": t_fwd, "forward_backward_s": t_train, "backward_s": t_bwd,
                         "ratios": r})
            if queued:
                q_fwd, q_train = queued["forward"], queued["forward_backward"]
                q = ratios(q_fwd["s"], q_train["s"], t_bwd, library)
                q.pop("bwd_split_over_fused")  # the backward alone is not timed queued
                rows[-1]["queued"] = queued_entry(q_fwd, q_train, q)
            ms = lambda t: f"{t * 1e3:7.2f}"  # noqa: E731
            line = f"{f'{m},{k},{n}':>16} {dname:>9} |"
            for phase, t in (("fwd", t_fwd), ("train", t_train)):
                line += (f" {ms(t['ours']):>12} {ms(t['eager'])} {ms(t['eager_packed'])} {ms(t['gemm'])} |"
                         f" {r[f'{phase}_eager_over_ours']:10.2f} {r[f'{phase}_eager_packed_over_ours']:11.2f}"
                         f" {r[f'{phase}_ours_over_gemm']:9.2f} |")
            print(line, flush=True)
            if "fwd_eager_onednn_over_ours" in r:
                print(f"{'':>28}GEMMs through {library}; eager oneDNN / ours: fwd {r['fwd_eager_onednn_over_ours']:.2f}, "
                      f"fwd+bwd {r['train_eager_onednn_over_ours']:.2f}; ours / ATen's GEMM: fwd "
                      f"{r['fwd_ours_over_aten_gemm']:.2f}, fwd+bwd {r['train_ours_over_aten_gemm']:.2f}", flush=True)
            if queued:
                q = rows[-1]["queued"]["ratios"]
                print(f"{'':>28}queued ({q_fwd['calls']} / {q_train['calls']} calls per sync): fwd eager/ours "
                      f"{q['fwd_eager_over_ours']:.2f}, packed/ours {q['fwd_eager_packed_over_ours']:.2f}, ours/gemm "
                      f"{q['fwd_ours_over_gemm']:.2f}; f+b eager/ours {q['train_eager_over_ours']:.2f}, packed/ours "
                      f"{q['train_eager_packed_over_ours']:.2f}, ours/gemm {q['train_ours_over_gemm']:.2f}"
                      f"{host_bound_note(rows[-1]['queued'], ('ours', 'gemm'))}", flush=True)
            print(f"{'':>28}backward alone: split (swiglu_backward + 2 GEMM ops) / fused "
                  f"{r['bwd_split_over_fused']:.2f}", flush=True)
            if args.compile:
                print(f"{'':>28}compile / ours: fwd {r['fwd_compile_over_ours']:.2f}, "
                      f"fwd+bwd {r['train_compile_over_ours']:.2f}", flush=True)
    payload = {"benchmark": "linear_swiglu", "machine": machine(), "build": parallel_layers.build_info(),
               "reps": args.reps, "rows": rows}
    path = write_json(args.name, payload)
    plot(rows, RESULTS / f"{args.name}.png")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
