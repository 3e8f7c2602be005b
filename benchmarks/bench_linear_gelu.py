"""Fused GEMM + bias + GeLU (`linear_gelu`) against what a user would otherwise run.

    python benchmarks/bench_linear_gelu.py [--device cpu|cuda] [--reps 15] [--quick]

For MLP shapes (M, K, N) and float32 / bfloat16 it times, interleaved in one run (median of
--reps calls after warm-up; each round in a shuffled order, _common.time_interleaved):
  forward (no grad):  ours | eager F.gelu(F.linear(...)) | torch.compile of that |
                      oneDNN's fused torch.ops.mkldnn._linear_pointwise (CPU) | F.linear alone
  forward + backward: ours | eager autograd | torch.compile | F.linear alone (fwd + bwd)
F.linear alone is the practical limit of the forward: the same GEMM with no GeLU at all, so
eager / GEMM alone (printed as "max") is the most any fusion can gain over eager there. For
forward + backward it is no bound: on CPU in bfloat16 our weight-gradient GEMM reads a
row-major dz^T, which oneDNN runs faster than F.linear's backward does its transposed view.
GeLU is the tanh approximation; oneDNN's fused op computes exact-erf GeLU, so it
is compared with ours at approximate="none". On CPU, bfloat16 forward without autograd is
oneDNN's fused op inside ours (Note [bfloat16 inference through oneDNN] in
csrc/linear_gelu.cpp): there "ours" and "oneDNN" are the same kernel. On CUDA, "ours" is the
default path (ATen's GEMM, then our GeLU kernel) and "ours, cuBLASLt" the opt-in cuBLASLt GELU
epilogue (Note [linear_gelu's CUDA forward path], csrc/cuda/linear_gelu.cpp; 16-bit only), timed
in the same run so that the default stays the faster one. On CUDA every variant is also timed
queued, several calls between two syncs (the row's "queued" entry; see bench_linear_swiglu.py):
the steady rate, the larger of host and GPU time per call, where the default samples are one
call's latency, host time included. Prints a table of ratios and writes
benchmarks/results/bench_linear_gelu.json and .png.
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
from parallel_layers import _C  # noqa: E402
from parallel_layers.ops import linear_gelu  # noqa: E402

SHAPES = [(2048, 1024, 4096), (512, 4096, 4096), (4096, 4096, 1024)]
QUICK_SHAPES = [(256, 256, 512)]


def eager(x, w, b, approximate="tanh"):
    return F.gelu(F.linear(x, w, b), approximate=approximate)


def onednn_available(x, w, b) -> bool:
    try:
        torch.ops.mkldnn._linear_pointwise(x[:1], w, b, "gelu", [], "none")
        return True
    except (AttributeError, RuntimeError):
        return False


def bench_case(m, k, n, dtype, device, reps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # A fresh dynamo cache per case: the recompile limit (8) counts every (shape, dtype, grad
    # mode) of `eager`, and past it torch.compile silently runs eager - timing the wrong thing.
    torch._dynamo.reset()
    compiled = torch.compile(eager)

    fwd = {
        "ours": lambda: linear_gelu(x, w, b),
        "eager": lambda: eager(x, w, b),
        "compile": lambda: compiled(x, w, b),
        "gemm_alone": lambda: F.linear(x, w, b),
    }
    if device == "cpu" and onednn_available(x, w, b):
        fwd["ours_erf"] = lambda: linear_gelu(x, w, b, "none")
        fwd["onednn_erf"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "none")
    lt = device == "cuda" and dtype in (torch.float16, torch.bfloat16) and hasattr(_C, "_set_cuda_gelu_path")
    if lt:
        fwd["ours_cublaslt"] = _on_cublaslt(fwd["ours"])
    queued = {}
    with torch.no_grad():
        t_fwd = time_interleaved(fwd, reps, sync=sync, shuffle=True)
        if device == "cuda":
            queued["forward"] = time_queued(fwd, reps, sync, t_fwd, shuffle=True)

    xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, b))

    def fwd_bwd(fn):
        def run():
            out = fn(xg, wg, bg)
            torch.autograd.grad(out, (xg, wg, bg), dy)
        return run

    train = {
        "ours": fwd_bwd(linear_gelu),
        "eager": fwd_bwd(eager),
        "compile": fwd_bwd(compiled),
        "gemm_alone": fwd_bwd(F.linear),
    }
    if lt:
        train["ours_cublaslt"] = _on_cublaslt(train["ours"])
    t_train = time_interleaved(train, reps, sync=sync, shuffle=True)
    if device == "cuda":
        queued["forward_backward"] = time_queued(train, reps, sync, t_train, shuffle=True)
    return t_fwd, t_train, queued


def _on_cublaslt(fn):
    """fn with linear_gelu's CUDA forward on the cuBLASLt epilogue (the setting restored after)."""
    def run():
        previous = _C._set_cuda_gelu_path("cublaslt")
        try:
            return fn()
        finally:
            _C._set_cuda_gelu_path(previous)
    return run


def ratios(t_fwd, t_train) -> dict:
    # fwd_eager_over_gemm is the ceiling of fwd_eager_over_ours: a fused op cannot beat its
    # own GEMM. train_eager_over_gemm is no ceiling (see the module doc), only context.
    r = {
        "fwd_eager_over_ours": t_fwd["eager"] / t_fwd["ours"],
        "fwd_eager_over_gemm": t_fwd["eager"] / t_fwd["gemm_alone"],
        "fwd_ours_over_gemm": t_fwd["ours"] / t_fwd["gemm_alone"],
        "fwd_compile_over_ours": t_fwd["compile"] / t_fwd["ours"],
        "train_eager_over_ours": t_train["eager"] / t_train["ours"],
        "train_eager_over_gemm": t_train["eager"] / t_train["gemm_alone"],
        "train_ours_over_gemm": t_train["ours"] / t_train["gemm_alone"],
        "train_compile_over_ours": t_train["compile"] / t_train["ours"],
    }
    if "onednn_erf" in t_fwd:
        r["fwd_onednn_over_ours_erf"] = t_fwd["onednn_erf"] / t_fwd["ours_erf"]
    if "ours_cublaslt" in t_fwd:
        r["fwd_cublaslt_over_ours"] = t_fwd["ours_cublaslt"] / t_fwd["ours"]
        r["train_cublaslt_over_ours"] = t_train["ours_cublaslt"] / t_train["ours"]
    return r


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['m']}x{r['k']}x{r['n']}\n{r['dtype']}" for r in rows]
    keys = [("fwd_eager_over_ours", "fwd: eager / ours"), ("train_eager_over_ours", "fwd+bwd: eager / ours"),
            ("fwd_compile_over_ours", "fwd: compile / ours"), ("fwd_ours_over_gemm", "fwd: ours / GEMM alone")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(keys)
    ceilings = {"fwd_eager_over_ours": "fwd_eager_over_gemm"}
    for i, (key, label) in enumerate(keys):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["ratios"][key] for r in rows], width, label=label)
        if key in ceilings:  # the most fusion could gain: eager / GEMM alone
            ax.scatter(xs, [r["ratios"][ceilings[key]] for r in rows], marker="_", s=120, color="black",
                       label="eager / GEMM alone (max)" if i == 0 else None, zorder=3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel("time ratio (>1: ours faster, except ours / GEMM)")
    ax.set_title(f"linear_gelu on {rows[0]['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="one small shape, for a smoke run")
    ap.add_argument("--name", default="bench_linear_gelu", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)

    rows = []
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(f"{'shape (M,K,N)':>20} {'dtype':>9} | {'fwd ms: ours':>12} {'eager':>7} {'compile':>7} {'gemm':>7} "
          f"{'onednn':>7} | {'eager/ours':>10} {'(max)':>6} {'ours/gemm':>9} | {'f+b ms: ours':>12} {'eager':>7} "
          f"{'gemm':>7} | {'eager/ours':>10} {'ours/gemm':>9} | {'GEMM GFLOP/s':>12}")
    print(f"{'':>31}(max) = eager / GEMM alone, forward: the most any fusion can gain over eager")
    for m, k, n in shapes:
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            t_fwd, t_train, queued = bench_case(m, k, n, dtype, args.device, args.reps)
            r = ratios(t_fwd, t_train)
            gemm_gflops = 2 * m * k * n / t_fwd["gemm_alone"] / 1e9
            rows.append({"m": m, "k": k, "n": n, "dtype": dname, "device": args.device,
                         "forward_s": t_fwd, "forward_backward_s": t_train, "ratios": r,
                         "gemm_alone_fwd_gflops": gemm_gflops})
            if queued:
                q_fwd, q_train = queued["forward"], queued["forward_backward"]
                rows[-1]["queued"] = queued_entry(q_fwd, q_train, ratios(q_fwd["s"], q_train["s"]))
            ms = lambda t: f"{t * 1e3:7.2f}"  # noqa: E731
            onednn = ms(t_fwd["onednn_erf"]) if "onednn_erf" in t_fwd else "    n/a"
            print(f"{str((m, k, n)):>20} {dname:>9} | {ms(t_fwd['ours']):>12} {ms(t_fwd['eager'])} "
                  f"{ms(t_fwd['compile'])} {ms(t_fwd['gemm_alone'])} {onednn} | {r['fwd_eager_over_ours']:10.2f} "
                  f"{r['fwd_eager_over_gemm']:6.2f} {r['fwd_ours_over_gemm']:9.2f} | {ms(t_train['ours']):>12} "
                  f"{ms(t_train['eager'])} {ms(t_train['gemm_alone'])} | {r['train_eager_over_ours']:10.2f} "
                  f"{r['train_ours_over_gemm']:9.2f} | {gemm_gflops:12.0f}",
                  flush=True)
            if queued:
                q = rows[-1]["queued"]["ratios"]
                print(f"{'':>32}queued ({q_fwd['calls']} / {q_train['calls']} calls per sync): fwd eager/ours "
                      f"{q['fwd_eager_over_ours']:.2f}, ours/gemm {q['fwd_ours_over_gemm']:.2f}; f+b eager/ours "
                      f"{q['train_eager_over_ours']:.2f}, ours/gemm {q['train_ours_over_gemm']:.2f}"
                      f"{host_bound_note(rows[-1]['queued'], ('ours', 'eager'))}", flush=True)
            if "fwd_onednn_over_ours_erf" in r:
                print(f"{'':>32}erf GeLU: ours {ms(t_fwd['ours_erf'])} ms, oneDNN fused {onednn} ms "
                      f"-> oneDNN / ours = {r['fwd_onednn_over_ours_erf']:.2f}", flush=True)
            if "fwd_cublaslt_over_ours" in r:
                print(f"{'':>32}cuBLASLt epilogue path: fwd {ms(t_fwd['ours_cublaslt'])} ms, f+b "
                      f"{ms(t_train['ours_cublaslt'])} ms -> cuBLASLt / ours = {r['fwd_cublaslt_over_ours']:.2f} "
                      f"(fwd), {r['train_cublaslt_over_ours']:.2f} (f+b)", flush=True)
    payload = {"benchmark": "linear_gelu", "machine": machine(), "build": parallel_layers.build_info(),
               "reps": args.reps, "rows": rows}
    path = write_json(args.name, payload)
    plot(rows, RESULTS / f"{args.name}.png")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
