"""Run every microbenchmark and write the report: benchmarks/results/<date>-<host>.md + plots.

    python benchmarks/run_all.py            # the full suite (~20 minutes on 2 cores, bench_hf ~8 of them)
    python benchmarks/run_all.py --quick    # small sizes, a smoke run of the whole pipeline
    python benchmarks/run_all.py --out DIR  # results and report under DIR
    python benchmarks/run_all.py --report-only   # rebuild the report from the results there

Each benchmark is its own script (run here one after the other, in a fresh process, with
its JSON under the results directory); the report gathers their numbers into tables of
ratios against the baseline measured in the same run, with the machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (script, full-run flags, quick-run flags)
SUITE = [
    ("bench_linear_gelu", [], ["--quick", "--reps", "3"]),
    ("bench_linear_swiglu", [], ["--quick", "--reps", "3"]),
    ("bench_rms_norm", [], ["--quick", "--reps", "3"]),
    ("bench_op_overhead", [], ["--reps", "3", "--calls", "20"]),
    ("bench_shard_copy", [], ["--reps", "3", "--world", "2"]),
    ("bench_tp_mlp", [], ["--seq", "64", "--d-model", "256", "--hidden", "1024", "--reps", "3", "--trials", "1",
                          "--dtypes", "float32"]),
    ("bench_zero", [], ["--layers", "2", "--d-model", "128", "--tokens", "64", "--reps", "3"]),
    ("bench_dp", [], ["--layers", "2", "--d-model", "128", "--tokens", "64", "--reps", "3"]),
    ("bench_pipeline", [], ["--stages", "2", "--reps", "2", "--forward-ms", "4"]),
    ("bench_scaling", [], ["--worlds", "1", "2", "--reps", "2", "--d-model", "64", "--layers", "2"]),
    ("bench_hf", [], ["--hidden", "128", "--layers", "2", "--vocab", "512", "--seq", "64", "--reps", "2",
                      "--trials", "1", "--dtypes", "float32"]),
    ("bench_fused_hf", [], ["--hidden", "128", "--layers", "2", "--vocab", "512", "--seq", "64", "--reps", "2",
                            "--dtypes", "float32"]),
]


def run_suite(out: Path, quick: bool, only: list[str] | None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_RESULTS_DIR": str(out)}
    runs = []
    suite = [s for s in SUITE if not only or s[0] in only]
    for i, (name, full, small) in enumerate(suite, 1):
        print(f"[{i}/{len(suite)}] {name} ...", end="", flush=True)
        start = time.perf_counter()
        r = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *(small if quick else full)], env=env,
                           capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(f" {'done' if r.returncode == 0 else 'FAILED'} in {seconds:.0f} s", flush=True)
        runs.append({"name": name, "ok": r.returncode == 0, "seconds": seconds, "stdout": r.stdout,
                     "stderr": r.stderr[-3000:]})
    return runs


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]


def section_linear_gelu(d: dict) -> list[str]:
    def ceiling(r, key):  # absent from results written before the column existed
        return r["ratios"].get(key, "-")
    rows = [[f"{r['m']}x{r['k']}x{r['n']}", r["dtype"], r["ratios"]["fwd_eager_over_ours"],
             ceiling(r, "fwd_eager_over_gemm"), r["ratios"]["fwd_compile_over_ours"],
             r["ratios"].get("fwd_onednn_over_ours_erf", "-"), r["ratios"]["fwd_ours_over_gemm"],
             r["ratios"]["train_eager_over_ours"], r["ratios"]["train_ours_over_gemm"]] for r in d["rows"]]
    return ["## Fused GEMM + bias + GeLU (`linear_gelu`)", "",
            "Speed-up of ours over each alternative (>1: ours faster), and ours over the GEMM alone "
            "(the practical limit; 1.0 is free fusion). \"max\" is eager / GEMM alone in the forward: the "
            "most any fusion could gain over eager in that run. bfloat16 forward (no autograd) on CPU runs "
            "oneDNN's fused op inside ours.", ""] + _table(
        ["M x K x N", "dtype", "eager/ours fwd", "max", "compile/ours fwd", "oneDNN/ours fwd (erf)",
         "ours/GEMM fwd", "eager/ours fwd+bwd", "ours/GEMM fwd+bwd"], rows) + [
        "", "![linear_gelu](bench_linear_gelu.png)", ""]


def section_linear_swiglu(d: dict) -> list[str]:
    rows = [[f"{r['m']}x{r['k']}x{r['n']}", r["dtype"]] + [r["ratios"][f"{phase}_{key}"]
                                                          for phase in ("fwd", "train")
                                                          for key in ("eager_over_ours", "eager_packed_over_ours",
                                                                      "ours_over_gemm")] for r in d["rows"]]
    return ["## Fused linear + SwiGLU (`linear_swiglu`)", "",
            "M x K x N = tokens x hidden -> ffn. Speed-up of ours over eager (two F.linear, F.silu, mul: a "
            "Hugging Face Llama MLP's gate and up) and over eager on the packed weight (>1: ours faster), and "
            "ours over the bare packed GEMM (1.0 is a free epilogue; target <= 1.05 in float32). On a CPU where "
            "oneDNN has no bfloat16 (AVX2 only: `oneDNN bf16` in the machine line is False) our bfloat16 GEMMs "
            "run in float32 (docs/kernels.md) and the eager and GEMM baselines run ATen's slow bfloat16 loops, so "
            "those ratios measure that, not the epilogue.", ""] + _table(
        ["M x K x N", "dtype", "eager/ours fwd", "eager packed/ours fwd", "ours/GEMM fwd", "eager/ours fwd+bwd",
         "eager packed/ours fwd+bwd", "ours/GEMM fwd+bwd"], rows) + [
        "", "![linear_swiglu](bench_linear_swiglu.png)", ""]


def section_rms_norm(d: dict) -> list[str]:
    rows = [[f"{r['rows']}x{r['hidden']}", r["dtype"], r["ratios"]["fwd_hf_over_ours"],
             r["ratios"]["fwd_add_hf_over_ours"], r["ratios"]["fwd_ours_over_copy"], r["ratios"]["train_hf_over_ours"],
             r["ratios"]["train_add_hf_over_ours"]] for r in d["rows"]]
    return ["## Fused RMSNorm (`rms_norm`, `rms_norm_add`)", "",
            "Speed-up of ours over Hugging Face's LlamaRMSNorm module (>1: ours faster), without and with the "
            "residual add, and ours over one copy of the input (the memory-traffic floor of the forward).",
            ""] + _table(
        ["rows x hidden", "dtype", "HF/ours fwd", "HF/ours fwd +add", "ours/copy fwd", "HF/ours fwd+bwd",
         "HF/ours fwd+bwd +add"], rows) + [""]


def section_op_overhead(d: dict) -> list[str]:
    rows = [[r["op"], *(r["us_per_call"][f"{mode}_{who}"] for mode in ("nograd", "grad", "train")
                        for who in ("ours", "eager")),
             r["ratios"]["train_eager_over_ours"]] for r in d["rows"]]
    return ["## Per-call host time of the fused ops (`bench_op_overhead`)", "",
            f"Microseconds per call at x [4, 8] on {d['rows'][0]['device']} (the arithmetic is nothing: dispatch, "
            "autograd, allocations and checks); eager / ours > 1: ours cheaper.", ""] + _table(
        ["op", "fwd no-grad ours", "eager", "fwd grad ours", "eager", "fwd+bwd ours", "eager",
         "eager/ours fwd+bwd"], rows) + [""]


def section_fused_hf(d: dict) -> list[str]:
    rows = [[r["hidden"], r["dtype"], r["ms"]["plain"], r["ms"]["fused"], r["ms"]["fused_no_add"],
             r["ratios"]["plain_over_fused"], r["ratios"]["no_add_over_fused"]] for r in d["rows"]]
    return ["## Fused kernels in a Hugging Face Llama step, one device (`bench_fused_hf`)", "",
            f"Milliseconds per training step on {d['rows'][0]['device']}: the model as transformers builds it, "
            "after `fused.fuse`, and fused but with the residual add apart; ratios > 1: the fused model faster.",
            ""] + _table(["hidden", "dtype", "plain ms", "fused ms", "fused, add apart ms", "plain/fused",
                          "add apart/fused"], rows) + [""]


def section_shard_copy(d: dict) -> list[str]:
    rows = [[k, v["GB_per_s"]["ours"], 1 / v["ours_over_torch_time"], v["ours_over_copy_time"]]
            for k, v in d["kernels"].items()]
    return [f"## Shard copy kernels (world {d['world']}, {d['elements_per_rank']} elements per rank)", ""] + _table(
        ["kernel", "ours GB/s", "speed-up over stock torch ops", "ours / one plain copy (time)"], rows) + [""]


def _trials(d: dict, key: str, dtype: str) -> str:
    """`; trials a, b, c` when the result keeps per-trial ratios (the value is their median)."""
    per_trial = d.get("trial_ratios", {}).get(f"{key}_{dtype}")
    return f"; median of trials {', '.join(f'{v:.2f}' for v in per_trial)}" if per_trial else ""


def section_ratio(title: str, d: dict, keys: list[tuple[str, str]]) -> list[str]:
    ratios = d.get("ratios", {})
    rows = [[label, ratios[k] if k in ratios else d.get(k)] for k, label in keys]
    return [f"## {title}", "", f"Arguments: `{json.dumps(d.get('args', {}))}`", ""] + _table(
        ["ratio", "value"], rows) + [""]


def section_pipeline(d: dict, out: Path) -> list[str]:
    rows = [[r["schedule"], r["p"], r["m"], r["v"], r["step_s"] * 1e3, r["bubble"], r["theory"], r["ratio"],
             r["peak_activation_bytes"] // 1024] for r in d["results"]]
    within = sum(abs(r["ratio"] - 1) <= 0.2 for r in d["results"])
    _plot_pipeline(d, out / "bench_pipeline.png")
    return ["## Pipeline schedules (simulated, balanced stages)", "",
            f"Bubble within 20% of theory in {within} of {len(rows)} configurations.", ""] + _table(
        ["schedule", "p", "m", "v", "step ms", "bubble", "theory", "bubble/theory", "stage-0 peak activations KiB"],
        rows) + ["", "![pipeline](bench_pipeline.png)", ""]


def section_scaling(d: dict, out: Path) -> list[str]:
    rows = [[r["world"], r["step_s"] * 1e3, r["tokens_per_s"], r["efficiency"]] for r in d["rows"]]
    _plot_scaling(d, out / "bench_scaling.png")
    return ["## Weak scaling (GPT, DataParallel, fixed batch per rank)", "",
            f"On {d['machine']['cores']} cores: ranks beyond that share cores.", ""] + _table(
        ["world", "ms/step", "tokens/s", "efficiency"], rows) + ["", "![scaling](bench_scaling.png)", ""]


def section_hf(d: dict) -> list[str]:
    kinds = ("ours", "hf_tp", "zero3", "fsdp2", "ddp", "zero3_unfused", "ddp_fused")
    rows = [[config, *(r["step_s"][k] * 1e3 if k in r["step_s"] else "-" for k in kinds),
             *(f"{r['ratios'][k]:.2f} ({', '.join(f'{v:.2f}' for v in r['trial_ratios'][k])})" if k in r["ratios"]
               else "-" for k in ("ours_over_hf_tp", "zero3_over_fsdp2", "zero3_over_ddp", "zero3_unfused_over_ddp",
                                  "zero3_over_ddp_fused"))]
            for config, r in d["results"].items()]
    a = d["args"]
    return ["## Hugging Face Llama step: tp=2 and dp=2 against the PyTorch-native stacks", "",
            f"Llama of {a['layers']} layers, vocabulary {a['vocab']}, [{a['batch']}x{a['seq']}] tokens per rank, "
            f"AdamW ({a.get('adamw', 'default')}, every variant), 2 ranks on gloo; ms per step (median over {a['trials']} trials) and ratios (median of the "
            "trials' ratios; per trial in brackets). Targets: ours / hf_tp <= 0.85, ZeRO-3 / FSDP2 <= 0.85, "
            "ZeRO-3 / DDP <= 1.15 (held to the same-kernel ratios too: ZeRO-3 unfused / DDP, ZeRO-3 / DDP fused). bfloat16 (mixed) at dp=2: every variant keeps float32 weights, reductions "
            "and AdamW (FSDP2 MixedPrecisionPolicy, DDP under autocast, ZeRO's float32 masters); (pure): FSDP2 and "
            "DDP all in bfloat16 (bench_hf.py's doc). ours and ZeRO-3 run parallelize's fused kernels (its "
            "default), the peers the model as transformers builds it; ZeRO-3 unfused / DDP and ZeRO-3 / DDP fused "
            "(DDP over fused.fuse(model)) compare ZeRO-3 and DDP with the same kernels. Load average after the run: "
            f"{' '.join(f'{v:.1f}' for v in d['machine'].get('loadavg_after', []))}.", ""] + _table(
        ["config", "ours tp2", "transformers tp_plan=auto", "ZeRO-3", "FSDP2", "DDP", "ZeRO-3 unfused", "DDP fused",
         "ours / tp_plan=auto", "ZeRO-3 / FSDP2", "ZeRO-3 / DDP", "ZeRO-3 unfused / DDP", "ZeRO-3 / DDP fused"], rows) + ["", "![hf](bench_hf.png)", ""]


def _plot_pipeline(d: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s in ("gpipe", "1f1b", "interleaved"):
        rs = [r for r in d["results"] if r["schedule"] == s]
        a.scatter([r["theory"] for r in rs], [r["bubble"] for r in rs], label=s)
        if s != "interleaved":
            for p in sorted({r["p"] for r in rs}):
                pts = [r for r in rs if r["p"] == p]
                b.plot([r["m"] for r in pts], [r["peak_activation_bytes"] / 1024 for r in pts], marker="o",
                       label=f"{s} p={p}")
    lim = max(r["bubble"] for r in d["results"]) * 1.1
    a.plot([0, lim], [0, lim], "k--", lw=1)
    a.set(xlabel="theory bubble fraction", ylabel="measured bubble fraction", title="bubble")
    b.set(xlabel="microbatches m", ylabel="stage-0 peak activations (KiB)", title="activation memory")
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_scaling(d: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["world"] for r in d["rows"]], [r["tokens_per_s"] for r in d["rows"]], marker="o", label="measured")
    ax.plot([r["world"] for r in d["rows"]], [d["rows"][0]["tokens_per_s"] * r["world"] for r in d["rows"]], "k--",
            label="perfect")
    ax.set(xlabel="world size", ylabel="tokens/s", title="weak scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(out: Path, runs: list[dict]) -> Path:
    import torch

    host = platform.node() or "host"
    stamp = datetime.date.today().isoformat()
    lines = [f"# Benchmark report {stamp} on {host}", ""]
    machine = next((d["machine"] for r in runs if (d := _load(out, r["name"]))), {})
    lines += [f"- machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
              + (f" ({', '.join(machine['cpu_flags']) or 'no AVX2'})" if "cpu_flags" in machine else "")
              + (f", oneDNN bf16 {machine['onednn_bf16']}" if "onednn_bf16" in machine else "")
              + (f", GPU {machine['gpu']}" if "gpu" in machine else ", no GPU"),
              f"- versions: torch {torch.__version__}, Python {platform.python_version()}",
              "- every ratio compares variants measured in the same run, interleaved round-robin (except "
              "the TP MLP's single-process baseline, timed in a separate phase: see bench_tp_mlp.py; and "
              "bench_zero's variants, each in a fresh pair of processes one after another)", "",
              "| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {'ok' if r['ok'] else 'FAILED'} | "
              f"{r['seconds']:.0f} |" if r["seconds"] == r["seconds"] else f"| {r['name']} | from an earlier run | - |"
              for r in runs]
    lines.append("")
    sections = {
        "bench_linear_gelu": lambda d: section_linear_gelu(d),
        "bench_linear_swiglu": lambda d: section_linear_swiglu(d),
        "bench_rms_norm": lambda d: section_rms_norm(d),
        "bench_op_overhead": section_op_overhead,
        "bench_shard_copy": lambda d: section_shard_copy(d),
        "bench_tp_mlp": lambda d: section_ratio("Tensor-parallel MLP vs DTensor (tp=2)", d, [
            (f"{k}_{dtype}", f"{label}, {dtype}{_trials(d, k, dtype) if k == 'ours_over_dtensor' else ''}")
            for dtype in d["args"].get("dtypes", [])
            for k, label in (("ours_over_dtensor", "ours / DTensor step time (target <= 0.8)"),
                             ("ours_over_single", "ours / one process (timed in a separate phase)"))]),
        "bench_zero": lambda d: section_ratio("ZeRO-3 vs FSDP2 vs DDP", d, [
            ("zero3_over_fsdp2_time", "ZeRO-3 / FSDP2 step time"),
            ("zero3_over_fsdp2_memory", "ZeRO-3 / FSDP2 peak memory"),
            ("zero3_over_ddp_time", "ZeRO-3 / DDP step time")]),
        "bench_dp": lambda d: section_ratio("DataParallel vs DDP", d, [
            ("ours_over_ddp", "ours / DDP step time (target <= 1.0)")]),
        "bench_pipeline": lambda d: section_pipeline(d, out),
        "bench_scaling": lambda d: section_scaling(d, out),
        "bench_hf": section_hf,
        "bench_fused_hf": section_fused_hf,
    }
    for r in runs:
        d = _load(out, r["name"]) if r["ok"] else None
        if d is None:
            lines += [f"## {r['name']}: FAILED", "", "```", r["stderr"], "```", ""]
            continue
        lines += sections[r["name"]](d)
    path = out / f"{stamp}-{host}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every script and the report")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", nargs="+", help="run these benchmarks only (names without .py)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild the report from the JSON results already in --out")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        runs = [{"name": name, "ok": (args.out / f"{name}.json").exists(), "seconds": float("nan"), "stdout": "",
                 "stderr": "no result file"} for name, _, _ in SUITE]
    else:
        runs = run_suite(args.out.resolve(), args.quick, args.only)
    path = write_report(args.out, runs)
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
