"""Where every tensor the library holds lives: one description, read by checkpoints,
gradient clipping and export.

Terms. A *logical tensor* is an entry of the unparallelized model's state_dict: its name
and shape. A rank holds it in a *local tensor* - the parameter itself, its tensor-parallel
shard, or, under ZeRO, a flat float32 shard of that - as a few *pieces*: boxes of the
logical tensor (offsets, sizes), each one a strided view of the local tensor.

Who says what (nobody reads another package's private state):
  tensor_parallel  sets a LocalLayout on every parameter it cuts (`set_local_layout`): the
                   boxes of the logical tensor the local tensor holds - one per fused block
                   ([q_r; k_r; v_r] is three boxes), vocabulary padding cropped off.
  describe_module  any nn.Module: its state_dict entries, each with its LocalLayout
                   (default: the whole tensor, replicated).
  wrappers         implement `state_placement(prefix) -> ModelPlacement`: ZeRO narrows each
                   parameter to this rank's flat shard (`flat_pieces`), PipelineStages renames
                   chunk-local keys to the unparallelized model's, DataParallel looks through.

`describe(model)` asks the outermost object. Consumers - `parallel_layers.checkpoint`,
`clip_grad_norm_` - use only the ModelPlacement it returns.

Note [flat pieces]: ZeRO keeps the row-major element range [start, stop) of the flattened
TP-local tensor. Such a range is a union of at most 2*ndim - 1 boxes of the TP-local tensor
(a partial row, whole rows, a partial last row; more in N-D), and each of those intersects
the TP layout's boxes in boxes again. Every resulting piece is a strided view of the flat
shard: offset = its origin's row-major index in the TP-local tensor minus `start`, strides =
the TP-local tensor's contiguous strides. So a ZeRO shard is described exactly, with no
copy and no collective, and a checkpoint holds no ZeRO or vocabulary padding.

Note [transposed weights]: transformers' Conv1D (GPT-2's layers) stores its weight [in, out];
the column and row layers `parallelize` makes of it hold theirs [out, in]. The state_dict entry
- what a checkpoint holds, what a plain GPT-2's `dcp.load` and the files of `save_pretrained`
expect - stays [in, out] at every layout (a GPT-2 checkpoint of tp=2 once held [out, in] and
one of tp=1 [in, out]: neither loaded into the other, nor the first into a plain GPT-2). The
layout says so (`transposed`); each piece is then the transpose of a box of the local tensor:
a strided view of it, as a flat ZeRO piece is of its shard (offsets, sizes and strides
reversed), so ZeRO over such a weight composes without a copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Box:
    """A box of the logical tensor held in a box of the local tensor (same number of dims)."""
    local_offsets: Shape
    global_offsets: Shape
    sizes: Shape


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """How a module's local tensor maps into its logical tensor. `global_shape` and the boxes
    are in the local tensor's orientation; `transposed` (2-d): the logical tensor, the state_dict
    entry, is the transpose of that (Note [transposed weights])."""
    global_shape: Shape
    boxes: tuple[Box, ...]
    replicated: bool = True  # False: the tensor is split over the tensor-parallel group
    transposed: bool = False

    @property
    def logical_shape(self) -> Shape:
        return tuple(self.global_shape[::-1]) if self.transposed else tuple(self.global_shape)

    @classmethod
    def whole(cls, shape) -> LocalLayout:
        shape = tuple(shape)
        return cls(shape, (Box((0,) * len(shape), (0,) * len(shape), shape),))


_LAYOUT_ATTR = "_parallel_layers_layout"


def set_local_layout(t: Tensor, layout: LocalLayout) -> None:
    """Record that the local tensor `t` holds `layout`'s boxes (tensor_parallel calls this)."""
    local, glob = tuple(t.shape), tuple(layout.global_shape)
    for b in layout.boxes:
        if not (len(b.sizes) == len(local) == len(glob) == len(b.local_offsets) == len(b.global_offsets)):
            raise ValueError(f"box {b} does not have the {len(local)} dims of the local tensor {local}")
        if any(o + s > n for o, s, n in zip(b.local_offsets, b.sizes, local)) or any(
                o + s > n for o, s, n in zip(b.global_offsets, b.sizes, glob)):
            raise ValueError(f"box {b} lies outside the local tensor {local} or the logical tensor {glob}")
    setattr(t, _LAYOUT_ATTR, layout)


def local_layout(t: Tensor) -> LocalLayout:
    """The layout recorded on `t`, or the whole tensor (a replicated or unparallelized one)."""
    layout = getattr(t, _LAYOUT_ATTR, None)
    return layout if layout is not None else LocalLayout.whole(t.shape)


def transposed(t: Tensor) -> None:
    """Record that the logical tensor of `t` (2-d) is its transpose (Note [transposed weights])."""
    layout = local_layout(t)
    if t.dim() != 2:
        raise ValueError(f"only a 2-d tensor can be held transposed, got one of shape {tuple(t.shape)}")
    setattr(t, _LAYOUT_ATTR, dataclasses.replace(layout, transposed=not layout.transposed))


def narrowed(layout: LocalLayout, dim: int, start: int, length: int) -> LocalLayout:
    """The layout of `local.narrow(dim, start, length)` for a local tensor with `layout`: each
    box cut to that range of the local tensor (boxes outside it dropped), its offsets moved."""
    boxes = []
    for b in layout.boxes:
        lo = max(b.local_offsets[dim], start)
        hi = min(b.local_offsets[dim] + b.sizes[dim], start + length)
        if hi <= lo:
            continue
        local, glob, sizes = list(b.local_offsets), list(b.global_offsets), list(b.sizes)
        glob[dim] += lo - local[dim]
        local[dim], sizes[dim] = lo - start, hi - lo
        boxes.append(Box(tuple(local), tuple(glob), tuple(sizes)))
    return LocalLayout(layout.global_shape, tuple(boxes), replicated=False, transposed=layout.transposed)


_EXPERT_GROUP_ATTR = "_parallel_layers_expert_group"


def set_expert_group(t: Tensor, group, replicas) -> None:
    """Record that `t` holds this rank's experts, split on dim 0 over the ranks of `group` (its
    expert-parallel group) and replicated over `replicas` (the data-parallel ranks with the same
    expert-parallel rank; this rank alone when the experts are spread over all of dp):
    parallel_layers/expert_parallel.py. The data-parallel wrappers broadcast and average it over
    `replicas`, not over dp (ZeRO shards it over them); gradient clipping sums it over `group`."""
    setattr(t, _EXPERT_GROUP_ATTR, (group, replicas))


def expert_group(t: Tensor):
    """The group `t`'s experts are split over (set_expert_group), or None."""
    return getattr(t, _EXPERT_GROUP_ATTR, (None, None))[0]


def expert_replica_group(t: Tensor):
    """The group `t`'s experts are replicated over (set_expert_group), or None."""
    return getattr(t, _EXPERT_GROUP_ATTR, (None, None))[1]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of the logical tensor, and where it lies in the local tensor: a box of it
    (`local_offsets`), or, for a flat ZeRO shard, a strided view (Note [flat pieces])."""
    global_offsets: Shape
    sizes: Shape
    local_offsets: Shape | None = None
    flat_offset: int | None = None
    flat_strides: Shape | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view(self, t: Tensor) -> Tensor:
        """The piece inside `t` (the local tensor, or a tensor of its shape and contiguity)."""
        if self.local_offsets is not None:
            for dim, (o, n) in enumerate(zip(self.local_offsets, self.sizes)):
                t = t.narrow(dim, o, n)
            return t
        if not t.is_contiguous():
            raise ValueError(f"a strided piece needs a contiguous local tensor (a flat ZeRO shard, or a transposed "
                             f"weight), got one of shape {tuple(t.shape)} and strides {t.stride()}")
        return t.as_strided(self.sizes, self.flat_strides, t.storage_offset() + self.flat_offset)


def _transposed(p: Piece) -> Piece:
    """A strided piece of the transposed logical tensor (Note [transposed weights])."""
    return Piece(p.global_offsets[::-1], p.sizes[::-1], flat_offset=p.flat_offset, flat_strides=p.flat_strides[::-1])


def box_pieces(layout: LocalLayout, local_shape: Shape | None = None) -> tuple[Piece, ...]:
    """The pieces of a local tensor that `layout` describes (`local_shape`: needed when it is
    transposed, whose pieces are strided views of it)."""
    boxes = [b for b in layout.boxes if math.prod(b.sizes) > 0]
    if not layout.transposed:
        return tuple(Piece(b.global_offsets, b.sizes, local_offsets=b.local_offsets) for b in boxes)
    strides = contiguous_strides(tuple(local_shape))
    return tuple(_transposed(Piece(b.global_offsets, b.sizes, flat_offset=sum(o * st for o, st in
                                                                               zip(b.local_offsets, strides)),
                                   flat_strides=strides)) for b in boxes)


def contiguous_strides(shape: Shape) -> Shape:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _range_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Shape, Shape]]:
    """The row-major element range [start, stop) of `shape` as boxes (origin, sizes)."""
    nd, strides, boxes = len(shape), contiguous_strides(shape), []
    if nd == 0:
        return [((), ())] if start < stop else []
    f = start
    while f < stop:
        idx = tuple((f // strides[d]) % shape[d] for d in range(nd))
        k = nd - 1  # the outermost dim whose whole blocks, from here, fit in [f, stop)
        for d in range(nd - 1, -1, -1):
            if all(i == 0 for i in idx[d + 1:]) and f + strides[d] <= stop:
                k = d
            else:
                break
        m = max(1, min(shape[k] - idx[k], (stop - f) // strides[k]))
        boxes.append((idx, (1,) * k + (m,) + tuple(shape[k + 1:])))
        f += m * strides[k]
    return boxes


def flat_pieces(layout: LocalLayout, local_shape: Shape, start: int, stop: int) -> tuple[Piece, ...]:
    """The pieces held by the element range [start, stop) of the flattened local tensor, as
    views of a flat shard that begins at element `start` (Note [flat pieces])."""
    local_shape = tuple(local_shape)
    stop = min(stop, math.prod(local_shape))
    strides = contiguous_strides(local_shape)
    pieces = []
    for origin, sizes in _range_boxes(local_shape, start, stop):
        for b in layout.boxes:
            lo = tuple(max(o, bo) for o, bo in zip(origin, b.local_offsets))
            hi = tuple(min(o + s, bo + bs) for o, s, bo, bs in zip(origin, sizes, b.local_offsets, b.sizes))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            glob = tuple(g + (l - bo) for g, l, bo in zip(b.global_offsets, lo, b.local_offsets))
            offset = sum(i * s for i, s in zip(lo, strides)) - start
            piece = Piece(glob, tuple(h - l for l, h in zip(lo, hi)), flat_offset=offset, flat_strides=strides)
            pieces.append(_transposed(piece) if layout.transposed else piece)
    return tuple(pieces)


@dataclasses.dataclass
class TensorPlacement:
    """This rank's part of one logical tensor."""
    name: str
    shape: Shape  # the logical tensor's
    local: Tensor  # what this rank reads and writes, and what its optimizer steps
    pieces: tuple[Piece, ...]
    tp_replicated: bool = True  # the same values on every rank of the TP group
    counted: bool = True  # False: a copy whose values another rank counts (a pipeline-tied weight)
    # the other keys of the same tensor in the unparallelized model's state_dict (a tied weight's:
    # an embedding read by the head), held here or on another pipeline rank
    aliases: tuple[str, ...] = ()

    @property
    def flat(self) -> bool:
        return any(p.local_offsets is None for p in self.pieces)


@dataclasses.dataclass
class ModelPlacement:
    """Every state_dict entry of a model as this rank holds it, in state_dict order. Tied
    entries (one tensor under two keys) share their `local`."""
    tensors: dict[str, TensorPlacement]
    shard_group: dist.ProcessGroup | None = None  # the locals are disjoint shards over this group (ZeRO)
    after_load: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # run once locals were written

    def check_storage(self) -> None:
        """Raise unless every tensor this rank holds pieces of has its storage: the full
        parameters of a model that ZeRO-3 shards have none between steps (reading them ends the
        process with SIGSEGV); its wrapper describes the shards instead (review finding)."""
        empty = [tp.name for tp in self.tensors.values() if tp.pieces and tp.local.numel() and not tp.local.is_meta
                 and tp.local.untyped_storage().nbytes() == 0]
        if empty:
            raise ValueError(f"{len(empty)} of the model's tensors (e.g. {empty[:3]}) have no storage: ZeRO-3 frees a "
                             "model's full parameters between steps. Pass what parallelize returned (par.module) or "
                             "the ZeRO wrapper, whose shards hold the values, not the model given to it")

    def by_local(self) -> dict[int, TensorPlacement]:
        """id(local tensor) -> its placement (the first key of tied entries)."""
        out: dict[int, TensorPlacement] = {}
        for tp in self.tensors.values():
            out.setdefault(id(tp.local), tp)
        return out


def describe_module(module: nn.Module, prefix: str = "") -> ModelPlacement:
    """The placement of a module's state_dict entries, from the layouts on its tensors."""
    tensors = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = prefix + key
        if not isinstance(t, Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__}; only tensors can be checkpointed "
                            "(move extra state into save(..., extra=...))")
        layout = local_layout(t)
        tensors[name] = TensorPlacement(name, layout.logical_shape, t, box_pieces(layout, tuple(t.shape)),
                                        layout.replicated)
    keys_of: dict[int, list[str]] = {}
    for name, tp in tensors.items():
        keys_of.setdefault(id(tp.local), []).append(name)
    for name, tp in tensors.items():
        tp.aliases = tuple(k for k in keys_of[id(tp.local)] if k != name)
    return ModelPlacement(tensors)


def describe(model: nn.Module, prefix: str = "") -> ModelPlacement:
    """What this rank holds of `model` (plain, tensor parallel, or wrapped by ZeRO,
    DataParallel, DistributedDataParallel, PipelineStages); `prefix` is prepended to names."""
    hook = getattr(model, "state_placement", None)
    if callable(hook):
        return hook(prefix)
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        return describe(model.module, prefix)
    return describe_module(model, prefix)
