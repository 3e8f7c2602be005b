"""Fused kernels for Hugging Face decoders: their modules swapped for fused ones over the same
parameters, so names, checkpoints and exports do not change.

    parallelize(model, ctx, ...)        # fused_kernels=True (the default) calls fuse(model)

What is swapped (Note [fused modules]):
  - a SwiGLU MLP - a module whose forward is Hugging Face's
    `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with a SiLU `act_fn` (Llama, Mistral, Qwen2,
    Qwen3 in transformers 5.23) - becomes `SwiGLUMLP` (tensor_parallel/layers.py): one GEMM
    on the packed [gate; up] weight with the activation in its epilogue (linear_swiglu),
    column-parallel when gate_proj / up_proj are.
  - an RMSNorm of the Llama form - a forward that is Hugging Face's LlamaRMSNorm's (Llama,
    Mistral, Qwen2, Qwen3, including Qwen3's per-head q_norm / k_norm) - becomes
    `FusedRMSNorm` (parallel_layers/ops/rms_norm.py) over the same weight Parameter: one pass
    forward, one backward, HF's roundings (docs/kernels.md, the RMSNorm contract).

Note [fused modules]: a module is recognised by what its forward computes, read from its
source, not by its class name: a family that writes the same expression is fused, one that
changes it (another activation, a gate applied elsewhere, a dropout) is left alone, so the
swap can never change the model's math. It runs after tensor parallelism converted the
linear layers (both projections column-parallel, or both plain) and before the sequence-
parallel hooks, which then land on the fused module under the same name (the final norm's
gather); the gradient sums of the norms' weights under sequence parallelism are hooks on the
weight Parameters, which the fused norms share.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from parallel_layers.ops.rms_norm import FusedRMSNorm
from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, SwiGLUMLP

_SWIGLU_FORWARD = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"
# LlamaRMSNorm.forward's body, whitespace removed (Qwen2's, Qwen3's and Mistral's are the same)
_RMS_NORM_FORWARD = ("input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)"
                     "variance=hidden_states.pow(2).mean(-1,keepdim=True)"
                     "hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)"
                     "returnself.weight*hidden_states.to(input_dtype)")


def _forward_source(module: nn.Module) -> str:
    try:
        return "".join(inspect.getsource(type(module).forward).split())
    except (OSError, TypeError):  # built without source (e.g. a C extension or a REPL class)
        return ""


def _is_silu(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _is_llama_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and _forward_source(module).endswith(_RMS_NORM_FORWARD))


def _swiglu_parts(module: nn.Module):
    """(gate_proj, up_proj, down_proj) if `module` is a SwiGLU MLP that SwiGLUMLP computes alike."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    gate, up, down = parts
    if not _is_silu(getattr(module, "act_fn", None)) or _SWIGLU_FORWARD not in _forward_source(module):
        return None
    if (type(gate), type(up)) == (ColumnParallelLinear, ColumnParallelLinear):
        if not isinstance(down, RowParallelLinear) or gate.gather_output or gate.activation or gate.fused_sizes:
            return None
    elif (type(gate), type(up)) != (nn.Linear, nn.Linear) or not isinstance(down, nn.Linear):
        return None
    return parts


def fuse(model: nn.Module) -> list[str]:
    """Swap every recognised module of `model` for its fused counterpart, in place (Note [fused
    modules]); returns the names swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not name:
            continue
        if _is_llama_rms_norm(module):
            fused = FusedRMSNorm.from_hf(module)
        else:
            parts = _swiglu_parts(module)
            if parts is None:
                continue
            fused = SwiGLUMLP(*parts)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, fused)
        swapped.append(name)
    return swapped


def pack(model: nn.Module) -> None:
    """Give the fused modules' packed tensors one allocation again (after `model.to(device)`,
    which gives every tensor storage of its own)."""
    for module in model.modules():
        if isinstance(module, SwiGLUMLP):
            module.pack_()


__all__ = ["fuse", "pack"]
