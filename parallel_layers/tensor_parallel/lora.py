"""peft's LoRA layers under tensor parallelism.

Note [LoRA under tensor parallelism]: a LoRA layer computes base(x) + s * B(A(dropout(x))), A
[r, in] and B [out, r] small. When the plan splits its base layer, the adapter is split with it,
so that each rank adds its share of the adapter's output where the base layer's output is its
share too, at the cost of one collective of [tokens, r] - r is 8-64 against thousands of
features - and without gathering anything of the size of the base:

  column (base output features split): B's rows split as the base's (a fused QKV's blocks
  alike), A whole. h = A(dropout(x)) is the same on every rank; each rank's B_i h is its
  features. Backward, dh = sum_i B_i^T dy_i is a sum over the ranks: with a replicated input
  (the base all-reduces its input gradient) h passes copy_to_tp, whose backward all-reduces
  [tokens, r], and then A's gradient and the adapter's input gradient are whole on every rank;
  where the region's entry reduces the input gradient (a region sharing one input, Note [one
  reduction per region]; every region under sequence parallelism) dh stays partial, the
  adapter's input gradient joins the base's partial one for that reduction, and A's gradient
  is summed over the group as it is made (reduce_grad_over_tp). A column that gathers its
  output (a head) gathers B_i h too.
  row (base input features split): A's columns split as the base's, B whole. A_i x_i is each
  rank's partial h; it is summed (all-reduce, or reduce-scatter onto this rank's sequence chunk
  under sequence parallelism) before B, so B h is whole (the chunk's) on every rank and is added
  after the base's own reduction. B's gradient is whole; under sequence parallelism each rank's
  covers its chunk and is summed over the group.

The branch runs before the base layer: its dropout draws where the layer's input lives - the
shared stream for a column's replicated input, this rank's stream inside a region for a row's
split input (region_random.py hooks the base layers). A region's first column enters this rank's
stream when it returns, so a later column's branch leaves it first (else k_proj's and v_proj's
masks differed across the ranks, which each then applied to their own output features: a
dropout no single process draws, and under a per-layer reduction A's gradients drifted apart;
review finding, helper-64). The layer keeps its names (base_layer,
lora_A, lora_B), so checkpoints, hf.save_pretrained's adapter export and hf.load_pretrained see
the same tensors as without tensor parallelism (the split ones carry their TPShard). Its class
becomes a subclass of peft's with this forward (as FSDP2 swaps a module's class); merging the
adapter into a split base is refused (merge_and_unload() the model before parallelize).

Not split: DoRA and peft's other LoRA variants, LoRA on an embedding (a vocab-parallel one), on
a column with a fused activation or on a row layer that splits its input itself: refused, naming
the layer. Mixed-adapter batches (adapter_names=) are refused at the call.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import _peft
from parallel_layers.tensor_parallel import comm, region_random
from parallel_layers.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, _input_comm,
                                                    reduce_grad_over_tp)
from parallel_layers.tensor_parallel.sharding import sharded_parameter


def is_lora_layer(module: nn.Module) -> bool:
    return _peft.is_lora_layer(module)


def refusal(name: str, layer: nn.Module, spec_kind: str, spec) -> str | None:
    """Why the plan's `spec` cannot split the LoRA layer `layer` (named `name`), or None."""
    what = f"{name} ({type(layer).__qualname__}, adapted by peft)"
    variants = sorted(getattr(layer, "lora_variant", {}) or {})
    if variants or any(getattr(layer, "use_dora", {}).values()):
        return (f"{what} uses a LoRA variant (DoRA or another: adapters {variants or sorted(layer.use_dora)}), "
                "which tensor parallelism does not split; use plain LoRA, or data parallelism for this model")
    if getattr(layer, "lora_embedding_A", None):
        return f"{what} adapts an embedding, which tensor parallelism does not split with its adapter"
    if getattr(layer, "merged", False):
        return f"{what} has its adapter merged into its weight: unmerge() it (or merge_and_unload()) before parallelize"
    if spec_kind == "column" and getattr(spec, "activation", None):
        return (f"{what} is a column layer with the activation after it fused ({spec.activation}): the adapter's "
                "output must be added before the activation; leave the activation out of the plan for it")
    if spec_kind == "row" and not getattr(spec, "input_is_parallel", True):
        return (f"{what} is a row layer that splits its own input (the plan gathers the region's column outputs, "
                f"as Phi-3's published plan does for attention), which its adapter would have to follow; leave "
                f"{name.rpartition('.')[2]} out of the adapter's target_modules, or parallelize with a plan whose "
                "row layers take split inputs")
    if spec_kind not in ("column", "row", "replicated"):
        return (f"{what} is planned {spec_kind!r}; tensor parallelism splits LoRA layers as 'column' or 'row' (or "
                "keeps them whole, 'replicated') only")
    return None


def convert(layer: nn.Module, tp_group: dist.ProcessGroup | None) -> None:
    """Split `layer`'s adapters as its base layer (already a Column- or RowParallelLinear, its
    settings final: shared_input, sequence_parallel) and give it the forward of Note [LoRA under
    tensor parallelism]."""
    base = layer.base_layer
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    column = isinstance(base, ColumnParallelLinear)
    for adapter in layer.lora_A:
        a, b = layer.lora_A[adapter], layer.lora_B[adapter]
        if column:
            for field in ("weight", "bias"):
                if getattr(b, field, None) is not None:
                    _split(b, field, 0, tp, rank, base.fused_sizes)
            b.out_features = b.weight.shape[0]
            partial = base.shared_input or (base.sequence_parallel and tp > 1)
            if partial:
                reduce_grad_over_tp(a.weight, tp_group)
        else:
            _split(a, "weight", 1, tp, rank, None)
            a.in_features = a.weight.shape[1]
            if base.sequence_parallel and tp > 1:
                for p in b.parameters():
                    reduce_grad_over_tp(p, tp_group)
    layer.__class__ = _tensor_parallel_class(type(layer))


def _split(module: nn.Module, field: str, dim: int, tp: int, rank: int, fused) -> None:
    old = getattr(module, field)
    new = sharded_parameter(old.detach(), dim, tp, rank, fused)
    new.requires_grad_(old.requires_grad)
    setattr(module, field, new)


def _forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    """Note [LoRA under tensor parallelism]: the active adapters' branch, then the split base."""
    if kwargs.get("adapter_names") is not None:
        raise ValueError(f"{type(self).__name__}: a batch of mixed adapters (adapter_names=) is not supported under "
                         "tensor parallelism; set one adapter active (set_adapter) for the whole batch")
    kwargs.pop("adapter_names", None)
    base = self.base_layer
    if self.disable_adapters or self.merged:
        return base(x, *args, **kwargs)
    extra = None
    for adapter in self.active_adapters:
        if adapter not in self.lora_A:
            continue
        a, b = self.lora_A[adapter], self.lora_B[adapter]
        xa = self._cast_input_dtype(x, a.weight.dtype) if hasattr(self, "_cast_input_dtype") else x
        if isinstance(base, ColumnParallelLinear):  # a replicated input: the shared stream's draw
            region_random.leave(x.device)
        h = a(self.lora_dropout[adapter](xa))
        if isinstance(base, ColumnParallelLinear):
            mode = _input_comm(base)
            if mode == "all_reduce":
                h = comm.copy_to_tp(h, base.tp_group)
            elif mode == "sequence":
                h = comm.gather_from_sp(h, base.tp_group, base.seq_dim)
            out = b(h) * self.scaling[adapter]
            if base.gather_output:
                out = comm.gather_from_tp(out, base.tp_group)
        else:
            split = base.sequence_parallel and comm.group_size(base.tp_group) > 1
            h = (comm.reduce_scatter_to_sp(h, base.tp_group, base.seq_dim) if split
                 else comm.reduce_from_tp(h, base.tp_group))
            out = b(h) * self.scaling[adapter]
        extra = out if extra is None else extra + out
    result = base(x, *args, **kwargs)
    return result if extra is None else result + extra.to(result.dtype)


def _merge(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__name__}: its base layer is split over the tensor-parallel group, and merging "
                       "the adapter into it is not supported; merge_and_unload() the model before parallelize, or "
                       "export the adapter (hf.save_pretrained) and merge it in one process")


_CLASSES: dict[type, type] = {}


def _tensor_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,),
                             {"forward": _forward, "merge": _merge, "__module__": __name__,
                              "__doc__": f"peft's {cls.__qualname__} with its base layer and adapters split over "
                                         "the tensor-parallel group (Note [LoRA under tensor parallelism])."})
    return _CLASSES[cls]


def tensor_parallel_base(module: nn.Module) -> nn.Module:
    """The Column- or RowParallelLinear doing `module`'s base computation: the module itself, or
    a split LoRA layer's base layer."""
    base = getattr(module, "base_layer", None)
    if is_lora_layer(module) and isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return base
    return module


__all__ = ["convert", "is_lora_layer", "refusal", "tensor_parallel_base"]
