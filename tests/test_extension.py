"""The compiled extension: build info, refusing a foreign torch, `python -m parallel_layers.info`,
and the CPU-only build (PARALLEL_LAYERS_FORCE_CPU=1)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallel_layers
from parallel_layers import _extension

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd, env_extra=None, timeout=600):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_build_info_describes_this_build():
    info = parallel_layers.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["cxx_standard"] >= 202002
    if torch.version.cuda is not None and os.environ.get("PARALLEL_LAYERS_FORCE_CPU") != "1" and info["cuda_compiled"]:
        archs = os.environ.get("PARALLEL_LAYERS_CUDA_ARCHS")
        if archs is None:  # the default arch list: A100 and H100, PTX for the newest
            assert info["cuda_archs"] == ["8.0", "9.0+PTX"]
        assert info["torch_cuda_version"] == torch.version.cuda
        assert info["cudart_version"] // 1000 == int(torch.version.cuda.split(".")[0])
    if torch.version.cuda is None:
        assert not info["cuda_compiled"] and info["cuda_archs"] == []


def test_mismatched_torch_is_refused_with_rebuild_hint(tmp_path):
    # A copy of the built package whose build record names another torch.
    pkg = tmp_path / "parallel_layers"
    shutil.copytree(ROOT / "parallel_layers", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "_build_meta.py").write_text("TORCH_VERSION = '2.0.0+cu117'\nCUDA_COMPILED = True\n")
    r = _run([sys.executable, "-c", "import parallel_layers"], cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert f"built against torch 2.0.0+cu117 but torch {torch.__version__} is installed" in r.stderr
    assert "Rebuild it against the installed torch" in r.stderr


def test_unbuilt_package_says_how_to_build(tmp_path):
    pkg = tmp_path / "parallel_layers"
    shutil.copytree(ROOT / "parallel_layers", pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_build_meta.py"))
    r = _run([sys.executable, "-c", "import parallel_layers"], cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "parallel_layers was not built" in r.stderr and "make build" in r.stderr


def test_check_torch_version():
    _extension.check_torch_version("2.14.1", "2.14.1")
    with pytest.raises(_extension.ExtensionMismatchError, match="built against torch 2.13.0 but torch 2.14.1"):
        _extension.check_torch_version("2.13.0", "2.14.1")


def test_info_cli_reports_build_devices_backends_and_torchrun():
    env = {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    r = _run([sys.executable, "-m", "parallel_layers.info"], cwd=ROOT, env_extra=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    info = parallel_layers.build_info()
    if info["cuda_compiled"]:
        assert f"CUDA kernels: compiled for {', '.join(info['cuda_archs'])}" in out
    else:
        assert "CUDA kernels: not compiled" in out
    assert f"built against torch {torch.__version__}" in out
    assert "[rank 3] " in out and "torchrun: rank 3 of world size 4, local rank 1 of 2, master 127.0.0.1:29500" in out
    assert "CUDA_VISIBLE_DEVICES=  CUDA_DEVICE_ORDER=PCI_BUS_ID" in out
    assert "CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible" in out
    assert "gloo yes" in out


def test_info_cli_outside_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "parallel_layers.info"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "not running under torchrun" in r.stdout


def test_compiled_archs_cover():
    from parallel_layers.info import _compiled_archs_cover

    archs = ["8.0", "9.0+PTX"]
    assert _compiled_archs_cover(archs, 8, 0)
    assert _compiled_archs_cover(archs, 9, 0)
    assert _compiled_archs_cover(archs, 12, 0)  # JIT from the sm_90 PTX
    assert not _compiled_archs_cover(archs, 8, 6)  # no sm_86 cubin, and PTX only from 9.0
    assert not _compiled_archs_cover(["8.0"], 9, 0)


@pytest.mark.slow  # a second whole build (~2.5 minutes on 2 cores); make test-slow, make test-cpu-torch
@pytest.mark.skipif(torch.version.cuda is None, reason="with a CPU torch every build is CPU-only already")
def test_force_cpu_build_builds_and_passes_op_tests(tmp_path):
    """PARALLEL_LAYERS_FORCE_CPU=1 gives a CPU-only extension whose op tests pass."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "csrc", "tools", "parallel_layers", "tests"):
        s = ROOT / name
        (shutil.copytree if s.is_dir() else shutil.copy)(
            s, src / name, **({"ignore": shutil.ignore_patterns("__pycache__", "_C*.so", "_build_meta.py")}
                              if s.is_dir() else {}))
    build = _run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], cwd=src,
                 env_extra={"PARALLEL_LAYERS_FORCE_CPU": "1"}, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "PARALLEL_LAYERS_FORCE_CPU=1, building CPU kernels only" in build.stdout
    probe = _run([sys.executable, "-c", "import parallel_layers as p; print(p.build_info()['cuda_compiled'])"],
                 cwd=src, env_extra={"PYTHONPATH": str(src)})
    assert probe.stdout.strip() == "False", probe.stderr
    tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops"], cwd=src,
                 env_extra={"PYTHONPATH": str(src)}, timeout=1200)
    assert tests.returncode == 0, tests.stdout[-5000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
