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
    replicated (do not), except one rank's experts under expert parallelism, which are other
    experts on each rank of their expert-parallel group (sum them over it,
    `placement.expert_group`; over their replica group they are replicated). Under ZeRO they
    are sharded over their replica group, so the shard group's (dp's) sum counts each expert
    once already.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault, placement


def _tp_rank(tp_group) -> int:
    return dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0


def grads_to_count(model: nn.Module, data_parallel, tp_group):
    """(gradients this rank counts in the norm, those of them that are one rank's experts to
    sum over their group when the shard group does not already, every gradient this rank
    would scale, the group whose ranks hold disjoint shards of them or None, the experts'
    group or None - decided by the model, not by which gradients exist, so every rank joins
    the same collectives)."""
    described = placement.describe(data_parallel if data_parallel is not None else model)
    tp_rank = _tp_rank(tp_group)
    counted, experts, every, expert_group = [], [], [], None
    for tp in described.by_local().values():
        group = placement.expert_group(tp.local) if described.shard_group is None else None
        expert_group = expert_group or group
        grad = tp.local.grad
        if grad is None:
            continue
        every.append(grad)
        if tp.counted and (not tp.tp_replicated or tp_rank == 0):
            (experts if group is not None else counted).append(grad)
    return counted, experts, every, described.shard_group, expert_group


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
    counted, experts, all_grads, shard_group, expert_group = grads_to_count(model, data_parallel, tp_group)
    # the compute device (a pipeline rank whose stages are all frozen has no gradient, and NCCL
    # takes no CPU tensor; an offloaded optimizer's shard gradients are on the CPU)
    device = next((p.device for p in model.parameters() if not p.is_meta),
                  all_grads[0].device if all_grads else torch.device("cpu"))
    sq = _sum_of_squares(counted, device)
    if expert_group is not None:
        sq += _all_reduced(_sum_of_squares(experts, device), expert_group)
    for group in (tp_group, pp_group, shard_group):
        sq = _all_reduced(sq, group)
    norm = sq.sqrt()
    # Scaled on the device, as torch.nn.utils.clip_grad_norm_ does: reading the norm back to
    # decide was a host synchronisation every step on a GPU. A coefficient of 1 scales too; a
    # non-finite norm scales every gradient by nan (inf: by 0), as the plain model's clip does.
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for (grad_device, _), grads in _by_device_and_dtype(all_grads).items():
        torch._foreach_mul_(grads, coef.to(grad_device))
    return norm


def _by_device_and_dtype(grads: list[Tensor]) -> dict[tuple, list[Tensor]]:
    """`grads` grouped for the foreach kernels, which take one device and dtype a call."""
    groups: dict[tuple, list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g.detach())
    return groups


def _sum_of_squares(grads: list[Tensor], device) -> Tensor:
    """The float32 sum of the gradients' squared elements: one foreach norm kernel per device
    and dtype (a pow and a sum per gradient before)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads_of_a_kind in _by_device_and_dtype(grads).values():
        # float32 at least: linalg's norm refuses a narrowing dtype (float64 gradients)
        dtype = torch.promote_types(grads_of_a_kind[0].dtype, torch.float32)
        norms = torch._foreach_norm(grads_of_a_kind, 2, dtype=dtype)
        sq += torch.stack(norms).to(device).pow(2).sum().float()
    return sq


def _all_reduced(sq: Tensor, group) -> Tensor:
    if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
        fault.check_agreement("gradient-norm all_reduce", sq, group)
        with fault.collective("gradient-norm all_reduce", group):
            dist.all_reduce(sq, group=group)
    return sq
