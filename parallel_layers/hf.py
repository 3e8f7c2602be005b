"""Hugging Face models in and out of any layout.

    hf.save_pretrained(model, "export/")        # every rank; any layout (TP, ZeRO, DataParallel)
    transformers.AutoModelForCausalLM.from_pretrained("export/")   # the plain model, same logits

Export goes through the checkpoint code (parallel_layers.checkpoint), which already turns every
layout into the unparallelized tensors: the ranks write their pieces as a temporary DCP
checkpoint inside `directory`, rank 0 reads it back whole, restores the Hugging Face layout of
weights that `parallelize` converted (GPT-2's Conv1D stores [in, out]; our column and row layers
hold [out, in]), and lets transformers write config and safetensors (tied weights once, shards
as transformers cuts them). Rank 0 holds the full model in host memory while writing, as
transformers' own save does.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn

from parallel_layers import checkpoint
from parallel_layers.checkpoint._dist import broadcast, describe_error, rank_world


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside wrappers (ZeRO, DataParallel, DDP, PipelineStages)."""
    seen = model
    while not hasattr(seen, "config") and hasattr(seen, "module"):
        seen = seen.module
    if getattr(seen, "named_after", None) is not None:  # the stages of pipeline_layers="auto" (pipeline/hf.py)
        seen = seen.named_after
    if not hasattr(seen, "config") or not hasattr(seen, "save_pretrained"):
        raise TypeError(f"hf.save_pretrained needs a transformers model (with .config), possibly wrapped by ZeRO or "
                        f"DataParallel; got {type(model).__name__}")
    return seen


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _to_hf_layout(state: dict[str, torch.Tensor], plain: nn.Module, held: nn.Module) -> dict[str, torch.Tensor]:
    """Transpose the weights of the Conv1D modules (weight [in, out]) that `parallelize`
    turned into our layers (weight [out, in]); decided by module type, not by shape (a square
    Conv1D weight looks the same either way)."""
    expected = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise KeyError(f"hf.save_pretrained: the model's tensors do not match {type(plain).__name__}'s: missing "
                       f"{missing[:5]}, unexpected {unexpected[:5]}")
    plain_modules, held_modules = dict(plain.named_modules()), dict(held.named_modules())
    out = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if leaf == "weight" and _is_conv1d(plain_modules.get(owner)) and not _is_conv1d(held_modules.get(owner)):
            value = value.t().contiguous()
        if tuple(value.shape) != expected[key]:
            raise ValueError(f"hf.save_pretrained: {key} is {tuple(value.shape)}, {type(plain).__name__} expects "
                             f"{expected[key]}")
        out[key] = value
    return out


def save_pretrained(model: nn.Module, directory: str, *, group=None, dtype: torch.dtype | None = None) -> str:
    """Write `model` (this rank's part of a transformers model, at any layout) as a directory
    that `transformers.AutoModelForCausalLM.from_pretrained(directory)` loads; a collective.
    dtype: cast the weights (default: as held; ZeRO's float32 masters for ZeRO parameters)."""
    hf_model = _hf_model(model)
    rank, _ = rank_world(group)
    staging = os.path.join(directory, ".parallel_layers-export")
    path = checkpoint.save(staging, 0, model, group=group)
    err = None
    if rank == 0:
        try:
            state = checkpoint.export_state_dict(path)
            with torch.device("meta"):
                plain = type(hf_model)(hf_model.config)
            state = _to_hf_layout(state, plain, hf_model)
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            plain.load_state_dict(state, strict=True, assign=True)
            plain.tie_weights()
            plain.save_pretrained(directory)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = describe_error(e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    err = broadcast(err, group)
    if err is not None:
        raise RuntimeError(f"hf.save_pretrained: rank 0 could not write {directory!r}: {err}")
    return directory


__all__ = ["save_pretrained"]
