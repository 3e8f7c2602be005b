"""Shard copy-in / copy-out for sharded data parallelism: one pass, many tensors per call.

Layout (csrc/include/parallel_layers/shard_layout.h): tensor i of numel n_i is padded to a
multiple of the world size W and cut into W shards of s_i = ceil(n_i / W) elements; a rank's
slot is its shards back to back (tensor i at offset o_i, total S); the all-gather and
reduce-scatter buffers are [W, S], rank-major.

  all_gather_copy_in     shards (this rank's, [s_i] each) -> new [W, S] buffer whose row
                         `rank` holds them cast to `dtype` (the all-gather input is that row)
  all_gather_copy_out    gathered [W, S] -> full unpadded tensors (written into `outs`)
  reduce_scatter_copy_in full gradients -> new [W, S] buffer: padded with zeros, rank-
                         interleaved, times pre_scale, cast to the reduce dtype
  reduce_scatter_copy_out this rank's reduced chunk [S] -> shard gradients, times post_scale,
                         cast, written or accumulated
Inputs of one call share one dtype; the buffer may have another (the cast is fused).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor


def shard_numel(numel: int, world_size: int) -> int:
    """s_i: elements per rank of a tensor of `numel` elements, padding included."""
    return -(-numel // world_size)


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def _buffer(shape: tuple[int, int], dtype: torch.dtype, device, empty) -> Tensor:
    return (empty or torch.empty)(shape, dtype=dtype, device=device)


def all_gather_copy_in(shards: Sequence[Tensor], world_size: int, rank: int, dtype: torch.dtype,
                       empty=None) -> Tensor:
    """[W, S] buffer with this rank's shards in row `rank` (other rows: filled by the all-gather).
    empty(shape, dtype=, device=): where the buffer comes from (default torch.empty)."""
    _check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}) (world_size {world_size})")
    device = shards[0].device if shards else None
    out = _buffer((world_size, sum(s.numel() for s in shards)), dtype, device, empty)
    torch.ops.parallel_layers.all_gather_copy_in(list(shards), out, rank)
    return out


def all_gather_copy_out(gathered: Tensor, outs: Sequence[Tensor]) -> None:
    """Write every full tensor out of the gathered [W, S] buffer into `outs` (any shapes)."""
    torch.ops.parallel_layers.all_gather_copy_out(gathered, list(outs))


def reduce_scatter_copy_in(grads: Sequence[Tensor], world_size: int, dtype: torch.dtype,
                           pre_scale: float = 1.0, empty=None) -> Tensor:
    """[W, S] reduce-scatter input: gradients padded, interleaved by rank, scaled, cast."""
    _check_world_size(world_size)
    device = grads[0].device if grads else None
    total = sum(shard_numel(g.numel(), world_size) for g in grads)
    out = _buffer((world_size, total), dtype, device, empty)
    torch.ops.parallel_layers.reduce_scatter_copy_in(list(grads), out, pre_scale)
    return out


def reduce_scatter_copy_out(reduced: Tensor, shard_grads: Sequence[Tensor], post_scale: float = 1.0,
                            accumulate: bool = False) -> None:
    """shard_grads[i] (+)= post_scale * this rank's reduced chunk of tensor i."""
    torch.ops.parallel_layers.reduce_scatter_copy_out(reduced, list(shard_grads), post_scale, accumulate)


@torch.library.register_fake("parallel_layers::all_gather_copy_in")
def _all_gather_copy_in_fake(shards, out, rank):
    return None


@torch.library.register_fake("parallel_layers::all_gather_copy_out")
def _all_gather_copy_out_fake(gathered, outs):
    return None


@torch.library.register_fake("parallel_layers::reduce_scatter_copy_in")
def _reduce_scatter_copy_in_fake(grads, out, pre_scale):
    return None


@torch.library.register_fake("parallel_layers::reduce_scatter_copy_out")
def _reduce_scatter_copy_out_fake(reduced, shard_grads, post_scale, accumulate):
    return None
