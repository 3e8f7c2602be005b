"""A rank's pieces of a logical tensor, presented to torch.distributed.checkpoint (DCP).

DCP writes and reads *chunks*: boxes of a logical tensor, each with its offsets and sizes,
named by (key, offsets); identical chunks from several ranks (replicas) are written once. A
TensorPlacement's pieces are exactly such boxes, so every piece becomes one chunk and the
files hold no padding and nothing of our layout: any DCP reader - another of our layouts,
FSDP2 + DTensor TP, a plain single-process `dcp.load` - finds each logical tensor under its
own name.

Note [presenting pieces]: two of DCP's interfaces carry several boxes per local tensor.
  - Box pieces (TP shards: one box per fused block, vocabulary padding cropped) use DCP's
    CheckpointableTensor protocol: an alias of the local tensor (`detach()`: same storage,
    the attributes stay off the parameter) with `global_shape`, `global_offsets`,
    `local_offsets` and `local_sizes`.
  - Flat pieces (a ZeRO shard, 1-d, while the logical tensor is N-d) cannot be described by
    local offsets; they use the hooks DTensor itself gives DCP, `__create_write_items__`,
    `__create_chunk_list__` and `__get_tensor_shard__`, bound to the alias. The protocol's
    attributes are set too (local offsets 0), because the load planner checks
    `global_shape` through them.
Pieces are plain data (offsets, strides), never captured views, so a copy of the alias made
for asynchronous saving resolves them against the copy.

Both interfaces are experimental in torch 2.14; tests/checkpoint/test_dcp.py pins them.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from parallel_layers.placement import Piece, TensorPlacement


def _write_items(self, fqn: str, _obj) -> list[WriteItem]:
    properties = TensorProperties.create_from_tensor(self)
    size = torch.Size(self.global_shape)
    return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.global_offsets), i), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(p.global_offsets),
                                                                             torch.Size(p.sizes)),
                                                  properties=properties, size=size))
            for i, p in enumerate(self._pl_pieces)]


def _chunks(self) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(torch.Size(p.global_offsets), torch.Size(p.sizes)) for p in self._pl_pieces]


def _shard(self, index: MetadataIndex) -> Tensor:
    pieces = self._pl_pieces
    i = index.index
    if i is None or i >= len(pieces) or torch.Size(pieces[i].global_offsets) != index.offset:
        matches = [j for j, p in enumerate(pieces) if torch.Size(p.global_offsets) == index.offset]
        if not matches:
            raise ValueError(f"{index.fqn}: this rank holds no piece at offsets {tuple(index.offset)}")
        i = matches[0]
    return pieces[i].view(self)


def present(local: Tensor, pieces: tuple[Piece, ...], shape: tuple[int, ...]) -> Tensor:
    """`local` (or a tensor shaped like it) as DCP should see it (Note [presenting pieces])."""
    if len(pieces) == 1 and pieces[0].local_offsets is not None and tuple(local.shape) == tuple(shape) \
            and tuple(pieces[0].sizes) == tuple(shape):
        return local.detach()  # the whole tensor: a plain tensor is what DCP expects
    t = local.detach()
    t.global_shape = tuple(shape)
    t.global_offsets = tuple(tuple(p.global_offsets) for p in pieces)
    t.local_sizes = tuple(tuple(p.sizes) for p in pieces)
    if all(p.local_offsets is not None for p in pieces):
        t.local_offsets = tuple(tuple(p.local_offsets) for p in pieces)
        return t
    t.local_offsets = tuple((0,) * local.dim() for _ in pieces)
    t._pl_pieces = pieces
    t.__create_write_items__ = types.MethodType(_write_items, t)
    t.__create_chunk_list__ = types.MethodType(_chunks, t)
    t.__get_tensor_shard__ = types.MethodType(_shard, t)
    return t


def present_placement(tp: TensorPlacement, local: Tensor | None = None) -> Tensor:
    """The placement's local tensor (or `local`, a tensor of its shape: a staged copy, an
    optimizer state) presented to DCP."""
    return present(tp.local if local is None else local, tp.pieces, tp.shape)
