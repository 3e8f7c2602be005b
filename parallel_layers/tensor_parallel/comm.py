"""Collectives of the tensor-parallel region, each one autograd Function.

Layout conventions: tensor-parallel splits are on the last dim (hidden). The sequence-parallel
split is on `seq_dim`: 0 for Megatron's [seq, batch, hidden] (the default; every chunk is
contiguous), 1 for Hugging Face's [batch, seq, hidden] (Note [strided sequence chunks]). Every
function is the identity at group size 1.

  copy_to_tp            identity forward,            all-reduce backward
  reduce_from_tp        all-reduce forward,          identity backward
  scatter_to_tp         split last dim forward,      all-gather last dim backward
  gather_from_tp        all-gather last dim forward, split last dim backward
  gather_from_sp        all-gather seq_dim forward,  reduce-scatter seq_dim backward (the
                        consumer is tensor-parallel: each rank's gradient is a partial sum);
                        with replicated_consumer=True, split seq_dim backward (the consumer
                        repeats the same full-sequence compute on every rank, e.g. an LM head,
                        so every rank's gradient is already the whole one: summing would
                        multiply it by tp)
  reduce_scatter_to_sp  reduce-scatter seq_dim forward, all-gather seq_dim backward
  scatter_to_sp         split seq_dim forward,       all-gather seq_dim backward

The lower-level helpers (`all_reduce`, `all_gather`, `reduce_scatter`) are what the layers'
own autograd Functions call, with `async_op=True` where backward overlaps communication.
"""

from __future__ import annotations

import math

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


# Note [strided sequence chunks]: the collectives move rank-major buffers: rank r's chunk is
# the r-th contiguous block. Viewing a tensor as [outer, ws, chunk, inner] around the split dim
# (outer = the product of the dims before it, inner = of those after it) puts rank r's chunk at
# [:, r]. When outer is 1 - dim 0, or a batch of one in [batch, seq, hidden] - that view IS the
# rank-major buffer and nothing is copied. Otherwise the all-gather lands in a rank-major
# buffer and one strided copy writes it into the preallocated [outer, ws * chunk, inner]
# output (no cat of chunk lists, no transpose of the activation around the collective), and
# the reduce-scatter makes its rank-major input with one strided copy; its output, this rank's
# [outer, chunk, inner], is already in place. Outputs are contiguous, as the fused ops need.
def _outer(shape, dim: int) -> int:
    """The element count of the dims before `dim` (Note [strided sequence chunks])."""
    return math.prod(shape[:dim])


def all_gather(x: Tensor, dim: int, group, async_op: bool = False):
    """Concatenate every rank's `x` along `dim` (rank order); contiguous. With async_op, a
    function that waits for the collective (fault.wait) and returns the result."""
    ws = group_size(group)
    if ws == 1:
        return (lambda: x) if async_op else x
    dim = dim % x.dim()
    check_agreement(f"all_gather(dim={dim})", x, group)
    x = x.contiguous()
    outer = _outer(x.shape, dim)
    buf = x.new_empty((ws * x.shape[0], *x.shape[1:]))  # rank-major: rank r's x is the r-th block
    with fault.collective("all_gather", group):
        handle = dist.all_gather_single(buf, x, group=group, async_op=async_op)
    shape = (*x.shape[:dim], ws * x.shape[dim], *x.shape[dim + 1:])

    def result() -> Tensor:
        fault.wait(handle, "all_gather", group)
        if outer == 1:  # the rank-major buffer is the result (Note [strided sequence chunks])
            return buf.view(shape)
        out = x.new_empty(shape)
        out.view(outer, ws, -1).copy_(buf.view(ws, outer, -1).transpose(0, 1))
        return out

    return result if async_op else result()


def reduce_scatter(x: Tensor, group, async_op: bool = False, dim: int = 0):
    """Sum `x` over the group and keep this rank's chunk of `dim`: (out, handle or None); out
    is contiguous."""
    ws = group_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % ws:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} evenly over {ws} ranks "
                         f"(shape {tuple(x.shape)}); under sequence parallelism the sequence length must "
                         f"divide by the tensor-parallel size")
    check_agreement("reduce_scatter" if dim == 0 else f"reduce_scatter(dim={dim})", x, group)
    outer = _outer(x.shape, dim)
    chunk = (*x.shape[:dim], x.shape[dim] // ws, *x.shape[dim + 1:])
    # the rank-major input (Note [strided sequence chunks]); this rank's block of it is `chunk`
    x = x.contiguous() if outer == 1 else x.reshape(outer, ws, -1).transpose(0, 1).contiguous()
    x = x.view(ws * chunk[0], *chunk[1:])  # the shape the collective checks: ws blocks of `chunk`
    out = x.new_empty(chunk)
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


class RegatheredInput:
    """The sequence a region's column layers gather again in backward, shared by them: the first
    one's all-gather, until the region's entry has run its backward (Note [re-gathering the
    sequence in backward] in layers.py)."""

    def __init__(self):
        self.tensor: Tensor | None = None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim, replicated_consumer, regathered):
        ctx.group, ctx.seq_dim, ctx.replicated_consumer = group, seq_dim, replicated_consumer
        ctx.regathered = regathered
        return all_gather(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        ctx.regathered.tensor = None  # every column layer of the region has run its backward
        if ctx.replicated_consumer:  # every rank holds the same whole gradient: keep this rank's chunk
            return split(grad, ctx.seq_dim, ctx.group), None, None, None, None
        return reduce_scatter(grad, ctx.group, dim=ctx.seq_dim)[0], None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return reduce_scatter(x, group, dim=seq_dim)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.seq_dim, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return split(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.seq_dim, ctx.group), None, None


def _identity_at_size_one(fn):
    def wrapper(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
        return x if group_size(group) == 1 else fn.apply(x, group)
    wrapper.__doc__ = fn.__doc__
    return wrapper


copy_to_tp = _identity_at_size_one(_CopyToTP)
reduce_from_tp = _identity_at_size_one(_ReduceFromTP)
scatter_to_tp = _identity_at_size_one(_ScatterToTP)
gather_from_tp = _identity_at_size_one(_GatherFromTP)


# Note [a forward without the sequence split]: a sequence-parallel model needs a sequence
# that divides by tp, which generation cannot give (each decoding step feeds one position). A
# forward without gradients (generate(), evaluate) whose sequence does not divide runs as
# plain tensor parallelism instead: the Hugging Face split at the first decoder layer
# (hf_sequence_parallel.py) turns this flag on for the rest of that forward, and the model's
# forward hook turns it off when the forward ends, normally or not. While it is on, the
# sequence collectives are their plain-TP counterparts - a gather or a scatter of the sequence
# is the identity, a reduce-scatter an all-reduce - and so are the layers' own (a row layer
# all-reduces, a column layer reads a replicated input). Only forwards: the backward of plain
# TP reduces in other places (a region's entry, not the norms' weights), so a forward with
# gradients never takes this path. The decision reads the hidden states' shape, which every
# rank of the TP group shares, so the ranks take it together.
_whole_sequence = False


def whole_sequence() -> bool:
    """True inside a sequence-parallel forward that runs as plain tensor parallelism (Note [a
    forward without the sequence split]); never with gradients on, whatever a forward that
    ended early left behind."""
    return _whole_sequence and not torch.is_grad_enabled()


def set_whole_sequence(on: bool) -> None:
    global _whole_sequence
    if on and torch.is_grad_enabled():
        raise RuntimeError("a sequence-parallel forward runs without its sequence split only without gradients "
                           "(Note [a forward without the sequence split])")
    _whole_sequence = on


def gather_from_sp(x: Tensor, group: dist.ProcessGroup | None = None, seq_dim: int = 0, *,
                   replicated_consumer: bool = False) -> Tensor:
    """All-gather the sequence (`seq_dim`); backward reduce-scatters the gradient, or, with
    replicated_consumer=True, keeps this rank's chunk of it (see the module doc)."""
    if group_size(group) == 1 or whole_sequence():
        return x
    seq_dim = seq_dim % x.dim()
    regathered = RegatheredInput()
    out = _GatherFromSP.apply(x, group, seq_dim, replicated_consumer, regathered)
    # Note [re-gathering the sequence in backward] in layers.py: a column layer reading `out`
    # saves this chunk for its weight gradient, not `out` - while neither was changed in place
    out._pl_sp_chunk = (x, group, seq_dim, regathered, x._version, out._version)
    return out


def reduce_scatter_to_sp(x: Tensor, group: dist.ProcessGroup | None = None, seq_dim: int = 0) -> Tensor:
    """Sum over the group and keep this rank's chunk of the sequence; backward all-gathers."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group) if whole_sequence() else _ReduceScatterToSP.apply(x, group, seq_dim % x.dim())


def scatter_to_sp(x: Tensor, group: dist.ProcessGroup | None = None, seq_dim: int = 0) -> Tensor:
    """This rank's chunk of the sequence of a replicated `x`; backward all-gathers."""
    return x if group_size(group) == 1 or whole_sequence() else _ScatterToSP.apply(x, group, seq_dim % x.dim())
