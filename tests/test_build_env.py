"""tools/build_env.py: finding the CUDA toolkit, the arch list, and the CPU-only fallbacks."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import build_env  # noqa: E402


@pytest.mark.parametrize("spec, expected", [
    ("80;90+PTX", "8.0;9.0+PTX"), ("sm_80 sm_90", "8.0;9.0"), ("8.0,9.0+PTX", "8.0;9.0+PTX"),
    ("120", "12.0"), ("90a", "9.0a"), ("compute_90+PTX", "9.0+PTX"),
])
def test_normalize_archs(spec, expected):
    assert build_env.normalize_archs(spec) == expected


@pytest.mark.parametrize("spec", ["", "ampere", "8.x"])
def test_normalize_archs_rejects(spec):
    with pytest.raises(ValueError, match="PARALLEL_LAYERS_CUDA_ARCHS"):
        build_env.normalize_archs(spec)


def test_force_cpu(capsys):
    assert build_env.cuda_plan("13.0", "2.14.1", env={"PARALLEL_LAYERS_FORCE_CPU": "1"}) == (None, None)
    assert "PARALLEL_LAYERS_FORCE_CPU=1, building CPU kernels only" in capsys.readouterr().out


def test_cpu_torch(capsys):
    assert build_env.cuda_plan(None, "2.13.0+cpu", env={}) == (None, None)
    assert "torch 2.13.0+cpu is a CPU build" in capsys.readouterr().out


def test_missing_nvcc_warns_and_builds_cpu_only(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc anywhere on PATH
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build_env, "STANDARD_TOOLKIT_DIRS", (str(tmp_path / "also-nowhere"),))
    with pytest.warns(UserWarning, match="no CUDA toolkit was found .* building CPU kernels ONLY"):
        assert build_env.cuda_plan("13.0", "2.14.1", env={}) == (None, None)


def test_toolkit_behind_a_wrapper_script(monkeypatch, tmp_path):
    """An nvcc on PATH that is a wrapper script still leads to the real toolkit."""
    real = build_env.find_cuda_toolkit()
    if real is None:
        pytest.skip("no CUDA toolkit on this machine")
    wrapper_dir = tmp_path / "bin"
    wrapper_dir.mkdir()
    (wrapper_dir / "nvcc").write_text(f'#!/bin/sh\nexec {real.nvcc} "$@"\n')
    (wrapper_dir / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper_dir}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build_env, "STANDARD_TOOLKIT_DIRS", ())
    found = build_env.find_cuda_toolkit()
    assert found is not None and found.root == real.root


def test_extension_with_the_shared_libstdcxx_passes():
    """Note [one libstdc++]: the extension this checkout built needs libstdc++.so.6."""
    import shutil
    built = sorted((Path(__file__).resolve().parent.parent / "parallel_layers").glob("_C*.so"))
    if not built or shutil.which("readelf") is None:
        pytest.skip("no built extension here, or no readelf")
    build_env.check_shared_libstdcxx(built[0], "c++")


def test_statically_linked_libstdcxx_is_refused(monkeypatch, tmp_path):
    """A library whose NEEDED list has no libstdc++ (a compiler wrapper with -static-libstdc++)
    is removed and the build fails, naming the compiler and the fix."""
    import types
    lib = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    lib.write_bytes(b"")
    readelf_out = (" 0x0000000000000001 (NEEDED)             Shared library: [libc10.so]\n"
                   " 0x0000000000000001 (NEEDED)             Shared library: [libgcc_s.so.1]\n")
    monkeypatch.setattr(build_env.shutil, "which", lambda name: "/usr/bin/readelf")
    monkeypatch.setattr(build_env.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(stdout=readelf_out, returncode=0))
    with pytest.raises(RuntimeError, match=r"linked without the shared libstdc\+\+ \(it needs libc10.so, "
                                           r"libgcc_s.so.1\): the C\+\+ compiler '/opt/gcc/bin/g\+\+' links "
                                           r"libstdc\+\+ statically.*CXX=/usr/bin/g\+\+"):
        build_env.check_shared_libstdcxx(lib, "/opt/gcc/bin/g++")
    assert not lib.exists()
