"""How a tensor-parallel parameter is cut: enough to gather it, re-split it or checkpoint it.

Every sharded parameter carries a `TPShard` as `param.tp_shard`: the tensor dim it is split
on, into how many equal parts, which part this rank holds, and - for fused weights such as
QKV or gate/up - the sizes of the logical sub-matrices along that dim, each of which is
split on its own (so rank r holds [q_r; k_r; v_r], never a slice that straddles q and k).
"""

from __future__ import annotations

import dataclasses
import numbers

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault
from parallel_layers.parallel_dims import divisors
from parallel_layers.placement import Box, LocalLayout, set_local_layout


@dataclasses.dataclass(frozen=True)
class TPShard:
    dim: int  # tensor dim that is split
    parts: int  # tensor-parallel size
    index: int  # which part this rank holds
    full_shape: tuple[int, ...]
    fused: tuple[int, ...] | None = None  # sizes of the logical sub-matrices along `dim`

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.fused if self.fused is not None else (self.full_shape[self.dim],)

    def layout(self, logical_rows: int | None = None) -> LocalLayout:
        """The boxes of the logical tensor this rank's part holds (one per fused block); with
        `logical_rows`, rows of dim 0 from there on are padding and are no part of it."""
        nd = len(self.full_shape)
        glob = list(self.full_shape)
        if logical_rows is not None:
            glob[0] = logical_rows
        boxes, local_along, start = [], 0, 0
        for block in self.blocks:
            size = block // self.parts
            lo, go, sz = [0] * nd, [0] * nd, list(self.full_shape)
            go[self.dim], lo[self.dim], sz[self.dim] = start + self.index * size, local_along, size
            if logical_rows is not None:  # crop the padding rows (dim 0)
                sz[0] = max(0, min(go[0] + sz[0], logical_rows) - go[0])
                # a rank whose rows are all padding (a vocabulary of 5 at tp=4: rows 6-7 of 8)
                # holds an empty box at the logical tensor's end, not one past it
                go[0] = min(go[0], logical_rows)
            boxes.append(Box(tuple(lo), tuple(go), tuple(sz)))
            local_along, start = local_along + size, start + block
        return LocalLayout(tuple(glob), tuple(boxes), replicated=self.parts == 1)


def sharded_parameter(full: Tensor, dim: int, tp: int, rank: int, fused: tuple[int, ...] | None = None,
                      logical_rows: int | None = None) -> nn.Parameter:
    """Rank `rank`'s part of `full` as a parameter, with its TPShard and its placement
    (parallel_layers.placement); `logical_rows`: dim 0 is padded beyond that many rows."""
    p = nn.Parameter(shard(full, dim, tp, rank, fused))
    p.tp_shard = TPShard(dim=dim, parts=tp, index=rank, full_shape=tuple(full.shape), fused=fused)
    set_local_layout(p, p.tp_shard.layout(logical_rows))
    return p


def keep_requires_grad(layer: nn.Module, replaced: nn.Module) -> nn.Module:
    """Give `layer`'s parameters the `requires_grad` of the same-named ones of the module it
    replaces: the sharded parameters are new tensors, and without this a weight the user froze
    before parallelize (a partial fine-tune) trained at tp > 1 (review finding)."""
    for name, param in layer.named_parameters(recurse=False):
        old = getattr(replaced, name, None)
        if isinstance(old, Tensor):
            param.requires_grad_(old.requires_grad)
    return layer


def check_size(size, what: str) -> None:
    """Raise unless `size` (a layer's feature or row count) is a non-negative integer."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {size!r}")


def check_divisible(size: int, parts: int, what: str) -> None:
    """Raise with the valid sizes when `size` cannot be split into `parts` equal pieces."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({parts}); "
                         f"valid tensor-parallel sizes for {size} are {divisors(size, 64)}")


def shard(full: Tensor, dim: int, parts: int, index: int, fused: tuple[int, ...] | None = None) -> Tensor:
    """Rank `index`'s part of `full` (each fused sub-matrix split on its own), contiguous."""
    blocks = fused if fused is not None else (full.shape[dim],)
    if sum(blocks) != full.shape[dim]:
        raise ValueError(f"fused sizes {blocks} do not add up to dim {dim} of shape {tuple(full.shape)}")
    pieces = []
    for block in full.split(list(blocks), dim=dim):
        check_divisible(block.shape[dim], parts, f"dim {dim} of a block of shape {tuple(block.shape)}")
        pieces.append(block.chunk(parts, dim=dim)[index])
    return torch.cat(pieces, dim=dim).contiguous()


def unshard(parts_list: list[Tensor], spec: TPShard) -> Tensor:
    """Inverse of `shard`: the full tensor from every rank's part (in rank order)."""
    per_rank = [p.split([b // spec.parts for b in spec.blocks], dim=spec.dim) for p in parts_list]
    blocks = [torch.cat([r[i] for r in per_rank], dim=spec.dim) for i in range(len(spec.blocks))]
    return torch.cat(blocks, dim=spec.dim)


def gather_full(param: Tensor, group: dist.ProcessGroup | None, spec: TPShard | None = None) -> Tensor:
    """All-gather a sharded parameter (with `tp_shard`, or cut as `spec`, e.g. its gradient)
    into the full tensor on every rank."""
    spec = spec if spec is not None else getattr(param, "tp_shard", None)
    if spec is None or spec.parts == 1:
        return param.detach().clone()
    parts_list = [torch.empty_like(param) for _ in range(spec.parts)]
    with fault.collective("gather of a tensor-parallel parameter", group):
        dist.all_gather(parts_list, param.detach().contiguous(), group=group)
    return unshard(parts_list, spec)
