"""Package boundaries: checkpoints and gradient clipping read only the placement description
(parallel_layers.placement), never the internals of the wrappers that produce it."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "parallel_layers"
ALLOWED = ("parallel_layers.checkpoint", "parallel_layers.placement", "parallel_layers.fault")
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
