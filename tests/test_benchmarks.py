"""The benchmark suite runs end to end (small sizes) and writes its report and plots."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_run_all_quick_writes_the_report(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = list(tmp_path.glob("*-*.md"))
    assert len(reports) == 1
    text = reports[0].read_text()
    for section in ("Fused GEMM + bias + GeLU", "Fused linear + SwiGLU", "Fused RMSNorm", "Per-call host time",
                    "Shard copy kernels",
                    "Tensor-parallel MLP vs DTensor", "ZeRO-3 vs FSDP2 vs DDP", "DataParallel vs DDP",
                    "Pipeline schedules", "Weak scaling", "Hugging Face Llama step", "Fused kernels in a Hugging Face Llama step"):
        assert f"## {section}" in text
    assert "FAILED" not in text
    for png in ("bench_linear_gelu.png", "bench_linear_swiglu.png", "bench_pipeline.png", "bench_scaling.png",
                "bench_hf.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_queued_timing_divides_by_the_calls_between_syncs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import queued_calls, time_interleaved
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    counts, syncs = {"a": 0, "b": 0}, []

    def bump(name):
        def fn():
            counts[name] += 1
        return fn

    t = time_interleaved({"a": bump("a"), "b": bump("b")}, reps=4, warmup=1, sync=lambda: syncs.append(1), calls=5)
    assert counts == {"a": 1 + 4 * 5, "b": 1 + 4 * 5}  # warm-up once, then 5 calls per sample
    assert len(syncs) == 1 + 2 * 4 * 2  # after warm-up, then before and after every sample
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())
    # enough calls for ~2 ms of the fastest variant, within [1, 20]
    assert queued_calls({"a": 1e-4, "b": 5e-4}) == 20
    assert queued_calls({"a": 2.5e-4, "b": 1.0}) == 8
    assert queued_calls({"a": 5e-3}) == 1


def test_queued_entry_marks_the_variants_whose_host_time_was_the_queued_time():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import host_bound_note, queued_entry
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    fwd = {"calls": 20, "s": {"ours": 10e-6, "gemm": 8e-6}, "host_s": {"ours": 9.5e-6, "gemm": 2e-6}}
    train = {"calls": 1, "s": {"ours": 2e-3, "gemm": 2e-3}, "host_s": None}  # one call: latency reused, no host
    entry = queued_entry(fwd, train, {"fwd_ours_over_gemm": 1.25})
    assert entry["forward_calls"] == 20 and entry["forward_backward_host_s"] is None
    assert host_bound_note(entry, ("ours", "gemm")) == "; host-bound: fwd ours"
    assert host_bound_note(entry, ("gemm",)) == ""


def test_bench_hf_lora_runs_every_variant_on_the_same_losses(tmp_path):
    """bench_hf.py --lora R (small sizes, one trial): every dp variant - ours and DDP / FSDP2 over
    the same peft model - trains to the same losses in float32, so the step times it compares are
    of the same training; transformers' tp_plan + peft peer is reported, not fatal, where it fails."""
    import json
    import os

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hf.py"), "--hidden", "64", "--layers", "1",
                        "--seq", "16", "--vocab", "256", "--reps", "1", "--trials", "1", "--dtypes", "float32",
                        "--lora", "4", "--name", "lora_smoke"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "zero3 / fsdp2 = " in r.stdout and "7 peft Linear" in r.stdout  # one layer's 7 LoRA layers, as printed
    (result,) = json.loads((tmp_path / "lora_smoke.json").read_text())["results"].values()
    for rank_losses in result["lora"][0]:
        losses = rank_losses["losses"]
        for kind in ("zero1", "zero3", "zero3_unfused", "fsdp2", "ddp"):
            assert losses[kind] == pytest.approx(losses["dataparallel"], rel=1e-5), (kind, losses)
