"""Where this rank's part of a logical tensor lies: in the full tensor, and in local storage.

Note [checkpoint pieces]: a logical tensor is an entry of the unparallelized model's
state_dict (or one optimizer state of it). A rank holds it as a few pieces, each
    a box of the logical tensor (offsets, sizes per dim), and under ZeRO
    an element range `flat` = [a, b) of that box read row-major (None: the whole box).
Tensor parallelism gives boxes: one per fused block (rank r holds [q_r; k_r; v_r], three
boxes on dim 0), one in all for an ordinary split, the whole tensor when replicated. ZeRO
flattens the rank's TP-local tensor and keeps a contiguous range of it, which cuts each
box into a row-major element range (the ZeRO padding lies past the tensor's end and is
never a piece). Vocabulary padding (rows past num_embeddings, always zero) is cropped off
dim 0: the logical embedding is the unpadded [num_embeddings, D] at every TP size. Since
dim 0 is outermost, the cropped part of a box is a prefix of the box in row-major order.

A Slot pairs a piece with where its data lives locally: a box of the local tensor (TP) or
an element range of this rank's flat ZeRO shard.
"""

from __future__ import annotations

import dataclasses
import math

from torch import Tensor

from parallel_layers.tensor_parallel.sharding import TPShard


@dataclasses.dataclass(frozen=True)
class Piece:
    offsets: tuple[int, ...]  # box origin in the logical tensor
    sizes: tuple[int, ...]  # box extent
    flat: tuple[int, int] | None = None  # element range [a, b) of the box, row-major; None = all of it

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(self.sizes)

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes),
                "flat": list(self.flat) if self.flat is not None else None}

    @classmethod
    def from_json(cls, d: dict) -> Piece:
        return cls(tuple(d["offsets"]), tuple(d["sizes"]), tuple(d["flat"]) if d["flat"] is not None else None)


def box_view(t: Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, n)
    return t


def piece_of(full: Tensor, piece: Piece) -> Tensor:
    """The piece's elements of a logical tensor: box-shaped, or 1-d for a flat range."""
    region = box_view(full, piece.offsets, piece.sizes)
    return region if piece.flat is None else region.reshape(-1)[piece.flat[0]:piece.flat[1]]


def write_piece(full: Tensor, piece: Piece, data: Tensor) -> None:
    """full[piece] = data (the inverse of piece_of)."""
    region = box_view(full, piece.offsets, piece.sizes)
    if piece.flat is None:
        region.copy_(data.view(region.shape))
    elif region.is_contiguous():
        region.view(-1)[piece.flat[0]:piece.flat[1]].copy_(data.view(-1))
    else:  # a box cut on an inner dim (row-parallel weight under ZeRO): reshape copies
        flat = region.reshape(-1)
        flat[piece.flat[0]:piece.flat[1]] = data.view(-1)
        region.copy_(flat.view(region.shape))


@dataclasses.dataclass(frozen=True)
class Slot:
    piece: Piece
    local_box: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (offsets, sizes) in the local tensor
    local_flat: tuple[int, int] | None = None  # element range of the flat local tensor (ZeRO shard)

    def view(self, local: Tensor) -> Tensor:
        """This piece's elements inside `local` (the TP-local tensor, or the ZeRO shard), as a view."""
        if self.local_flat is not None:
            return local.view(-1)[self.local_flat[0]:self.local_flat[1]]
        return box_view(local, *self.local_box)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]  # the logical tensor's
    slots: tuple[Slot, ...]


def layout_of(name: str, local_shape: tuple[int, ...], spec: TPShard | None, logical_shape: tuple[int, ...],
              zero: tuple[int, int] | None = None) -> TensorLayout:
    """The slots of a tensor held as `local_shape` (TP-cut by `spec`), optionally flattened and
    sharded by ZeRO over `zero` = (world, rank); `logical_shape` crops padded rows."""
    local_shape, logical_shape = tuple(local_shape), tuple(logical_shape)
    nd = len(local_shape)
    full_shape = tuple(spec.full_shape) if spec is not None else local_shape
    boxes = []  # (full offsets, local offsets, sizes)
    if spec is None:
        boxes.append(((0,) * nd, (0,) * nd, full_shape))
    else:
        local_along, start = 0, 0
        for block in spec.blocks:
            size = block // spec.parts
            fo, lo, sz = [0] * nd, [0] * nd, list(full_shape)
            fo[spec.dim], lo[spec.dim], sz[spec.dim] = start + spec.index * size, local_along, size
            boxes.append((tuple(fo), tuple(lo), tuple(sz)))
            local_along, start = local_along + size, start + block
        expected = tuple(local_along if d == spec.dim else n for d, n in enumerate(full_shape))
        if expected != local_shape:
            raise ValueError(f"{name}: tp_shard {spec} implies a local shape {expected}, but the tensor is "
                             f"{local_shape}")
    if logical_shape != full_shape:
        if nd == 0 or logical_shape[1:] != full_shape[1:] or logical_shape[0] > full_shape[0]:
            raise ValueError(f"{name}: logical shape {logical_shape} must equal the full shape {full_shape} "
                             "except for fewer rows on dim 0 (padding)")
        boxes = [(fo, lo, (max(0, min(fo[0] + sz[0], logical_shape[0]) - fo[0]),) + sz[1:]) for fo, lo, sz in boxes]
    if zero is None:
        return TensorLayout(logical_shape, tuple(Slot(Piece(fo, sz), local_box=(lo, sz))
                                                 for fo, lo, sz in boxes if math.prod(sz) > 0))
    if len(boxes) > 1 and spec.dim != 0:
        raise NotImplementedError(f"{name}: fused blocks split on dim {spec.dim} are interleaved in the flat ZeRO "
                                  "shard; only fused blocks on dim 0 can be checkpointed under ZeRO")
    world, rank = zero
    n = math.prod(local_shape)
    shard = math.ceil(n / world)
    lo_r, hi_r = rank * shard, min((rank + 1) * shard, n)
    inner = math.prod(local_shape[1:]) if nd else 1
    slots = []
    for fo, lo, sz in boxes:
        a = lo[0] * inner if nd else 0  # where the box starts in the flat local tensor (boxes are whole rows)
        x, y = max(lo_r, a), min(hi_r, a + math.prod(sz))
        if x < y:
            slots.append(Slot(Piece(fo, sz, (x - a, y - a)), local_flat=(x - lo_r, y - lo_r)))
    return TensorLayout(logical_shape, tuple(slots))
