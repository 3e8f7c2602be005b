"""Find what a build of parallel_layers needs: the CUDA toolkit, the `nvidia` wheels' cuBLAS
headers and libraries, and the CUDA archs to compile for.

Used by setup.py (imported by path, before torch.utils.cpp_extension is imported, because
that module fixes CUDA_HOME at import time) and by the Makefile for the CMake build
(`python tools/build_env.py --cmake-args`). Only the standard library is used here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"  # A100, H100; PTX of the newest so later GPUs can JIT it
STANDARD_TOOLKIT_DIRS = ("/usr/local/cuda",)


@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    root: Path  # the directory holding bin/nvcc
    nvcc: Path
    version: str  # "13.0"


def _is_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").is_file() and (
        (root / "include" / "cuda_runtime.h").is_file()
        or any(root.glob("targets/*/include/cuda_runtime.h"))
    )


def _nvcc_version(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _toolkit_of_nvcc_on_path() -> Path | None:
    """The toolkit root of the `nvcc` on PATH, even when that nvcc is a wrapper script.

    `nvcc --dryrun` prints the directory it really runs from (`#$ TOP=<root>/bin/..`), which
    a symlink or wrapper in /usr/local/bin would otherwise hide.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-v", "-c", "x.cu"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, flags=re.M)
    if m:
        return Path(m.group(1).strip()).resolve()
    return Path(nvcc).resolve().parent.parent


def find_cuda_toolkit() -> CudaToolkit | None:
    """CUDA_HOME / CUDA_PATH if they hold a toolkit, else the nvcc on PATH, else STANDARD_TOOLKIT_DIRS."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates.append(str(_toolkit_of_nvcc_on_path() or ""))
    candidates.extend(STANDARD_TOOLKIT_DIRS)
    for c in candidates:
        if not c:
            continue
        root = Path(c).resolve()
        if _is_toolkit(root):
            nvcc = root / "bin" / "nvcc"
            version = _nvcc_version(nvcc)
            if version is not None:
                return CudaToolkit(root=root, nvcc=nvcc, version=version)
    return None


def nvidia_wheel_dirs(cuda_major: str) -> tuple[Path, Path] | None:
    """(include, lib) of the `nvidia` wheels torch installs, e.g. site-packages/nvidia/cu13.

    The toolkit here ships no cuBLAS; these wheels do (versioned .so names only).
    """
    purelib = Path(sysconfig.get_paths()["purelib"])
    for base in (purelib / "nvidia" / f"cu{cuda_major}", purelib / "nvidia" / "cublas"):
        if (base / "include" / "cublasLt.h").is_file():
            return base / "include", base / "lib"
    return None


def normalize_archs(spec: str) -> str:
    """'80;90+PTX', 'sm_80 sm_90', '8.0;9.0+PTX' -> '8.0;9.0+PTX' (TORCH_CUDA_ARCH_LIST form)."""
    out = []
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)(?:\.(\d+))?([a-z]?)(\+PTX)?", tok, flags=re.I)
        if not m:
            raise ValueError(
                f"PARALLEL_LAYERS_CUDA_ARCHS entry {tok!r} is not an arch; use e.g. '80;90+PTX' or '8.0;9.0+PTX'")
        major, minor, suffix, ptx = m.groups()
        if minor is None:  # "80" -> 8.0, "120" -> 12.0, "90a" -> 9.0a
            major, minor = major[:-1], major[-1]
        out.append(f"{int(major)}.{minor}{suffix.lower()}{'+PTX' if ptx else ''}")
    if not out:
        raise ValueError("PARALLEL_LAYERS_CUDA_ARCHS is empty; use e.g. '80;90+PTX'")
    return ";".join(out)


def cuda_plan(torch_cuda_version: str | None, torch_version: str, env=os.environ):
    """(toolkit, archs) for a CUDA build, or (None, None) for a CPU-only one, saying why.

    CPU-only when PARALLEL_LAYERS_FORCE_CPU=1, when torch is a CPU build, or - with a loud
    warning, since the user likely expected CUDA kernels - when no toolkit is found.
    """
    if env.get("PARALLEL_LAYERS_FORCE_CPU", "0") == "1":
        print("parallel_layers: PARALLEL_LAYERS_FORCE_CPU=1, building CPU kernels only")
        return None, None
    if torch_cuda_version is None:
        print(f"parallel_layers: torch {torch_version} is a CPU build, building CPU kernels only")
        return None, None
    toolkit = find_cuda_toolkit()
    if toolkit is None:
        warnings.warn(
            f"parallel_layers: torch {torch_version} is a CUDA {torch_cuda_version} build but no CUDA toolkit "
            "was found (no nvcc on PATH, CUDA_HOME unset or without bin/nvcc): building CPU kernels ONLY. "
            "Install the CUDA toolkit or set CUDA_HOME, then rebuild, to get the CUDA kernels.", stacklevel=2)
        return None, None
    archs = normalize_archs(env.get("PARALLEL_LAYERS_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
    print(f"parallel_layers: CUDA kernels for {archs} with nvcc {toolkit.version} from {toolkit.root}")
    return toolkit, archs


def check_shared_libstdcxx(extension: Path, cxx: str) -> None:
    """Refuse an extension linked without the shared libstdc++ (Note [one libstdc++]).

    Note [one libstdc++]: torch's libraries use the shared libstdc++.so.6. A C++ compiler that
    links libstdc++ statically (a wrapper passing -static-libstdc++; one GPU image here had one
    as its default CXX) gives the extension its own copy of the C++ runtime, and two copies of
    the iostream and locale state in one process crash: every error message that formats a
    value (TORCH_CHECK(..., x.sizes())) segfaulted in std::ostream instead of raising, while
    the kernels themselves ran. readelf's list of the extension's NEEDED libraries shows it;
    where readelf is missing the check is skipped.
    """
    readelf = shutil.which("readelf")
    if readelf is None:
        return
    out = subprocess.run([readelf, "-d", str(extension)], capture_output=True, text=True, timeout=60).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    if needed and not any(lib.startswith("libstdc++.so") for lib in needed):
        extension.unlink()
        raise RuntimeError(
            f"{extension.name} was linked without the shared libstdc++ (it needs {', '.join(needed)}): the C++ "
            f"compiler {cxx!r} links libstdc++ statically, and a second C++ runtime next to torch's crashes "
            "the first time an error message is formatted (Note [one libstdc++], tools/build_env.py). Build with "
            "a compiler that links it dynamically, e.g. CXX=/usr/bin/g++.")


def cmake_args() -> list[str]:
    """Hints the CMake build needs to find Torch (and CUDA, for a CUDA torch) on this machine."""
    import torch  # noqa: PLC0415 - only this entry point needs torch
    import torch.utils

    args = [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]
    if torch.version.cuda is None:
        return args
    toolkit = find_cuda_toolkit()
    wheels = nvidia_wheel_dirs(torch.version.cuda.split(".")[0])
    if toolkit is not None:
        # An explicit arch list stops torch's CMake config from probing for GPUs (a try_run
        # that fails to configure with CMake 3.25 + nvcc 13).
        archs = normalize_archs(os.environ.get("PARALLEL_LAYERS_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
        args += [f"-DTORCH_CUDA_ARCH_LIST={archs}", f"-DCUDAToolkit_ROOT={toolkit.root}", f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit.root}",
                 f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}"]
    if wheels is not None:
        inc, lib = wheels
        nvrtc = sorted(lib.glob("libnvrtc.so.*"))
        if nvrtc:
            args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}")
        args += [f"-DPL_NVIDIA_WHEEL_INCLUDE={inc}", f"-DPL_NVIDIA_WHEEL_LIB={lib}"]
    return args


if __name__ == "__main__":
    if sys.argv[1:] == ["--cmake-args"]:
        print(" ".join(cmake_args()))
    elif sys.argv[1:] == ["--toolkit"]:
        tk = find_cuda_toolkit()
        print(tk.root if tk else "")
    else:
        sys.exit("usage: build_env.py --cmake-args | --toolkit")
