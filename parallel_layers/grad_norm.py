"""Gradient clipping by the global norm of a model spread over data, tensor and pipeline axes.

The norm must be the one the unparallelised model would have. Each rank sums the squares
of the gradient elements it is the one to count, then one all-reduce per axis adds them up.
What a rank holds comes from its placement (parallel_layers.placement), whatever wraps it:
  - a tensor-parallel shard is counted by its rank: the shards partition the full tensor; a
    parameter replicated over the TP group is counted by TP rank 0 only;
  - a pipeline stage's parameters live on its rank only; a tied parameter (embedding and LM
    head on the first and last stage) is counted once, on its lowest stage (`counted`);
  - under ZeRO the gradients are disjoint shards over the data-parallel group (the
    placement's `shard_group`: sum over it); after DataParallel's all-reduce they are
    replicated (do not).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault, placement


def _tp_rank(tp_group) -> int:
    return dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0


def grads_to_count(model: nn.Module, data_parallel=None, tp_group=None):
    """(gradients this rank counts in the norm, every gradient this rank would scale, the
    group whose ranks hold disjoint shards of them or None)."""
    described = placement.describe(data_parallel if data_parallel is not None else model)
    tp_rank = _tp_rank(tp_group)
    counted, every = [], []
    for tp in described.by_local().values():
        grad = tp.local.grad
        if grad is None:
            continue
        every.append(grad)
        if tp.counted and (not tp.tp_replicated or tp_rank == 0):
            counted.append(grad)
    return counted, every, described.shard_group


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
    counted, all_grads, shard_group = grads_to_count(model, data_parallel, tp_group)
    device = all_grads[0].device if all_grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        sq += g.detach().float().pow(2).sum()
    axes = [tp_group, pp_group, shard_group]
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
