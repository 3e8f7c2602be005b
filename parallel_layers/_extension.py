"""Loads the compiled extension `parallel_layers._C`, refusing one built against another torch.

A C++ extension is tied to the exact torch it was compiled against (C++ ABI, op schemas);
loading it into another torch fails later with an undefined symbol or a crash. So the torch
version recorded at build time (parallel_layers/_build_meta.py, written by setup.py) is
compared with the installed one first, and any load failure says how to rebuild.
"""

from __future__ import annotations

import importlib

import torch

_REBUILD_HINT = (
    "Rebuild it against the installed torch: `make build` in a source checkout, or "
    "`pip install --no-build-isolation --force-reinstall --no-deps .` (or reinstall a wheel built "
    "for torch {installed})."
)


class ExtensionMismatchError(ImportError):
    """The compiled extension does not belong to the installed torch."""


def _load_meta():
    try:
        return importlib.import_module("parallel_layers._build_meta")
    except ImportError as e:
        raise ImportError(
            "parallel_layers was not built (parallel_layers/_build_meta.py is missing). "
            + _REBUILD_HINT.format(installed=torch.__version__)) from e


def check_torch_version(built: str, installed: str) -> None:
    """Raise ExtensionMismatchError if the extension was built for another torch."""
    if built != installed:
        raise ExtensionMismatchError(
            f"parallel_layers._C was built against torch {built} but torch {installed} is installed. "
            + _REBUILD_HINT.format(installed=installed))


def load():
    meta = _load_meta()
    check_torch_version(meta.TORCH_VERSION, torch.__version__)
    try:
        module = importlib.import_module("parallel_layers._C")
    except ImportError as e:
        raise ImportError(
            f"parallel_layers._C failed to load ({e}). It was built against torch {meta.TORCH_VERSION}; "
            f"torch {torch.__version__} is installed. " + _REBUILD_HINT.format(installed=torch.__version__)
        ) from e
    check_torch_version(module.build_info()["torch_version"], torch.__version__)
    return module
