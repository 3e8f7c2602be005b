"""Package boundaries: checkpoints and gradient clipping read only the placement description
(parallel_layers.placement), never the internals of the wrappers that produce it."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "parallel_layers"
# random_states: a registry of the library's own random streams (a leaf: torch only), which the
# checkpoint saves beside the default generators' without importing the modules that keep them
ALLOWED = ("parallel_layers.checkpoint", "parallel_layers.placement", "parallel_layers.fault",
           "parallel_layers.random_states")
CONSUMERS = sorted((ROOT / "checkpoint").glob("*.py")) + [ROOT / "grad_norm.py"]


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] if node.module != "parallel_layers" else [
                f"parallel_layers.{a.name}" for a in node.names]
    return [n for n in names if n == "parallel_layers" or n.startswith("parallel_layers.")]


@pytest.mark.parametrize("path", CONSUMERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_consumers_of_the_placement_import_nothing_else_of_the_library(path):
    bad = [n for n in _imports(path) if not n.startswith(ALLOWED)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; it may use only {ALLOWED}"


def test_the_check_sees_imports():  # the parser finds what a forbidden import would look like
    assert _imports(ROOT / "data_parallel.py")  # it imports parallel_layers.fault and placement


# Note [kernels apart from torch's headers] (csrc/include/parallel_layers/cuda/kernels.h): nvcc
# compiles only the kernels, against c10's scalar types and our own math headers, so that the
# CUDA build does not parse torch's headers once per arch; the ops around them are host C++.
CSRC = ROOT.parent / "csrc"
KERNEL_HEADERS_ALLOWED = {"ATen/OpMathType.h", "c10/util/Half.h", "c10/util/BFloat16.h",
                          "c10/cuda/CUDAException.h"}


def _includes(path: pathlib.Path, seen: set) -> set[str]:
    """The <...> headers a file includes, through our own "parallel_layers/..." headers."""
    import re

    found = set()
    for kind, name in re.findall(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', path.read_text(), flags=re.M):
        ours = CSRC / "include" / name
        if kind == '"' and ours.is_file():
            if ours not in seen:
                seen.add(ours)
                found |= _includes(ours, seen)
        else:
            found.add(name)
    return found


KERNEL_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))


@pytest.mark.parametrize("path", KERNEL_SOURCES, ids=lambda p: p.name)
def test_cuda_kernels_include_no_torch_headers(path):
    torch_headers = {h for h in _includes(path, set()) if h.split("/")[0] in ("ATen", "c10", "torch", "caffe2")}
    assert torch_headers <= KERNEL_HEADERS_ALLOWED, (
        f"{path.name} includes {sorted(torch_headers - KERNEL_HEADERS_ALLOWED)}; kernels may use only "
        f"{sorted(KERNEL_HEADERS_ALLOWED)} of torch (Note [kernels apart from torch's headers])")


@pytest.mark.parametrize("path", sorted((CSRC / "cuda").glob("*.cpp")), ids=lambda p: p.name)
def test_cuda_ops_hold_no_kernels(path):  # the host compiler builds these
    text = path.read_text()
    assert "<<<" not in text and "__global__" not in text, f"{path.name} holds device code; move it to a .cu"


def test_the_include_check_sees_torch_headers():  # it would catch an op's includes in a kernel file
    assert KERNEL_SOURCES and "ATen/ATen.h" in _includes(CSRC / "cuda" / "bias_gelu.cpp", set())
    assert "ATen/core/Tensor.h" in _includes(CSRC / "cuda" / "rms_norm.cpp", set())  # through rms_norm.h
