"""The benchmark suite runs end to end (small sizes) and writes its report and plots."""

import subprocess
import sys
from pathlib import Path

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
