"""Gradient clipping by the global norm of a model spread over data, tensor and pipeline axes.

The norm must be the one the unparallelised model would have. Each rank sums the squares
of the gradient elements it is the one to count, then one all-reduce per axis adds them up:
  - a tensor-parallel shard (it has `tp_shard`) is counted by its rank: the shards partition
    the full tensor; a parameter replicated over the TP group is counted by TP rank 0 only;
  - a pipeline stage's parameters live on its rank only; a tied parameter (embedding and LM
    head on the first and last stage) is counted once, on its lowest stage;
  - under ZeRO the gradients are sharded over the data-parallel group (sum over it); after
    DataParallel's all-reduce they are replicated (do not).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault

def _tp_rank(tp_group) -> int:
    return dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0


def _counted(p: nn.Parameter, tp_rank: int, model: nn.Module) -> bool:
    spec = getattr(p, "tp_shard", None)
    if (spec is None or spec.parts == 1) and tp_rank != 0:
        return False
    counted_once = getattr(model, "counted_once", None)
    return counted_once(p) if counted_once is not None else True


def grads_to_count(model: nn.Module, data_parallel=None, tp_group=None) -> tuple[list[Tensor], list[Tensor]]:
    """(gradients this rank counts in the norm, every gradient this rank would scale)."""
    tp_rank = _tp_rank(tp_group)
    groups = getattr(data_parallel, "groups", None)  # ZeRO: the shards hold the gradients
    if groups is not None:
        pairs = [(p, s.grad) for g in groups for p, s in zip(g.params, g.shards)]
    else:
        pairs = [(p, p.grad) for p in model.parameters()]
    pairs = [(p, g) for p, g in pairs if g is not None]
    return [g for p, g in pairs if _counted(p, tp_rank, model)], [g for _, g in pairs]


def clip_grad_norm_(model: nn.Module, max_norm: float, *, data_parallel=None, tp_group=None, pp_group=None,
                    eps: float = 1e-6) -> Tensor:
    """Scale every gradient by min(1, max_norm / norm); returns the global norm before clipping.

    `model`: this rank's part of the model (for pipelines, its PipelineStages); `data_parallel`:
    the ZeRO or DataParallel wrapper around it, if any (called after gradients are reduced).
    """
    try:
        positive = bool(max_norm > 0)  # False for nan, which would silently never clip
    except TypeError:
        positive = False
    if not positive:
        raise ValueError(f"max_norm must be positive (a number; float('inf') never clips), got {max_norm!r}")
    counted, all_grads = grads_to_count(model, data_parallel, tp_group)
    device = all_grads[0].device if all_grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        sq += g.detach().float().pow(2).sum()
    axes = [tp_group, pp_group]
    if hasattr(data_parallel, "groups"):
        axes.append(data_parallel.group or dist.group.WORLD)
    if dist.is_initialized():
        for group in axes:
            if group is not None and dist.get_world_size(group) > 1:
                fault.check_agreement("gradient-norm all_reduce", sq, group)
                with fault.collective("gradient-norm all_reduce", group):
                    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    scale = max_norm / (norm.item() + eps)
    if scale < 1.0:
        for g in all_grads:
            g.mul_(scale)
    return norm
