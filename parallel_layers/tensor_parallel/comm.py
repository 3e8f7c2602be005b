"""Collectives of the tensor-parallel region, each one autograd Function.

Layout conventions: activations are [seq, batch, hidden] (Megatron's order) so that the
sequence-parallel split is on dim 0 and every chunk is contiguous; tensor-parallel splits
are on the last dim (hidden). Every function is the identity at group size 1.

  copy_to_tp            identity forward,            all-reduce backward
  reduce_from_tp        all-reduce forward,          identity backward
  scatter_to_tp         split last dim forward,      all-gather last dim backward
  gather_from_tp        all-gather last dim forward, split last dim backward
  gather_from_sp        all-gather dim 0 forward,    reduce-scatter dim 0 backward
  reduce_scatter_to_sp  reduce-scatter dim 0 forward, all-gather dim 0 backward
  scatter_to_sp         split dim 0 forward,         all-gather dim 0 backward

The lower-level helpers (`all_reduce`, `all_gather`, `reduce_scatter`) are what the layers'
own autograd Functions call, with `async_op=True` where backward overlaps communication.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault
from parallel_layers.fault import check_agreement


def _check_member(group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group (its ranks are "
                         f"{dist.get_process_group_ranks(group)}); pass the tensor-parallel group this rank "
                         "belongs to, e.g. init_parallel(...).tp_group")


def group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 1
    _check_member(group)
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 0
    _check_member(group)
    return dist.get_rank(group)


def all_reduce(x: Tensor, group, async_op: bool = False):
    """Sum `x` in place over the group; returns the work handle when async_op (wait for it
    with fault.wait, so a failure names the ranks)."""
    check_agreement("all_reduce", x, group)
    with fault.collective("all_reduce", group):
        return dist.all_reduce(x, group=group, async_op=async_op)


def all_gather(x: Tensor, dim: int, group) -> Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    ws = group_size(group)
    if ws == 1:
        return x
    check_agreement(f"all_gather(dim={dim})", x, group)
    x = x.contiguous()
    out = x.new_empty((ws * x.shape[0], *x.shape[1:]))  # rank-major along dim 0
    with fault.collective("all_gather", group):
        dist.all_gather_single(out, x, group=group)
    return out if dim == 0 else torch.cat(out.chunk(ws, 0), dim=dim)


def reduce_scatter(x: Tensor, group, async_op: bool = False):
    """Sum `x` over the group and keep this rank's chunk of dim 0: (out, handle or None)."""
    ws = group_size(group)
    if x.shape[0] % ws:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.shape[0]} evenly over {ws} ranks "
                         f"(shape {tuple(x.shape)}); under sequence parallelism the sequence length must "
                         f"divide by the tensor-parallel size")
    check_agreement("reduce_scatter", x, group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // ws, *x.shape[1:]))
    with fault.collective("reduce_scatter", group):
        handle = dist.reduce_scatter_single(out, x, group=group, async_op=async_op)
    return out, handle


def split(x: Tensor, dim: int, group) -> Tensor:
    """This rank's chunk of `x` along `dim` (the dim must divide by the group size)."""
    ws = group_size(group)
    if ws == 1:
        return x
    if x.shape[dim] % ws:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {ws} ranks "
                         f"(shape {tuple(x.shape)})")
    return x.chunk(ws, dim=dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, -1, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group)[0], None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, 0, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, 0, ctx.group), None


def _identity_at_size_one(fn):
    def wrapper(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
        return x if group_size(group) == 1 else fn.apply(x, group)
    wrapper.__doc__ = fn.__doc__
    return wrapper


copy_to_tp = _identity_at_size_one(_CopyToTP)
reduce_from_tp = _identity_at_size_one(_ReduceFromTP)
scatter_to_tp = _identity_at_size_one(_ScatterToTP)
gather_from_tp = _identity_at_size_one(_GatherFromTP)
gather_from_sp = _identity_at_size_one(_GatherFromSP)
reduce_scatter_to_sp = _identity_at_size_one(_ReduceScatterToSP)
scatter_to_sp = _identity_at_size_one(_ScatterToSP)
