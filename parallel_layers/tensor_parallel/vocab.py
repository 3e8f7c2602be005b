"""Vocabulary-parallel embedding, tied output logits and cross-entropy.

The vocabulary is padded to a multiple of the TP size (padded rows are zero and never
selected) and split on dim 0: rank r holds rows [r * V_r, (r + 1) * V_r), V_r = V_pad / tp.

  VocabParallelEmbedding     ids [...] -> [..., D]: each rank looks up the ids it owns,
                             zeros elsewhere, and the partial results are all-reduced
                             (SP: reduce-scattered on dim 0, activations [seq, batch, D];
                             `partial_output`: returned unreduced, for a consumer that
                             reduce-scatters them itself, as Hugging Face sequence
                             parallelism does at decoder layer 0's input).
  vocab_parallel_logits      hidden [..., D] -> local logits [..., V_r] with the embedding's
                             weight (tied head): copy-to-TP (SP: all-gather) then a local GEMM.
  vocab_parallel_cross_entropy  local logits + global targets -> loss, never gathering the
                             [..., V] logits: 1 all-reduce (max) and 1 all-reduce (sum of
                             exp, target logit) forward; backward is local.
  tied_logits, tied_cross_entropy  what single-device model code calls for a head tied to its
                             nn.Embedding: F.linear and F.cross_entropy, until a plan's
                             VocabParallel() makes the embedding a VocabParallelEmbedding;
                             then the two above (Note [vocab-parallel head]).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from parallel_layers import fault
from parallel_layers._device_assert import assert_async
from parallel_layers._token_ids import TokenIdError
from parallel_layers.tensor_parallel import comm
from parallel_layers.tensor_parallel.sharding import check_size, keep_requires_grad, sharded_parameter


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split over the TP group (see the module doc)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 sequence_parallel: bool = False, tp_group: dist.ProcessGroup | None = None, device=None, dtype=None,
                 _full: Tensor | None = None):
        super().__init__()
        tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        check_size(num_embeddings, "VocabParallelEmbedding num_embeddings")
        check_size(embedding_dim, "VocabParallelEmbedding embedding_dim")
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx must be in [0, {num_embeddings}), got {padding_idx}")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        # True: forward returns this rank's partial sum [..., D]; whoever reads it must sum it
        # over tp (tensor_parallel/hf_sequence_parallel.py sets it and reduce-scatters it).
        self.partial_output = False
        self.padded_num_embeddings = math.ceil(num_embeddings / tp) * tp
        self.rows_per_rank = self.padded_num_embeddings // tp
        self.vocab_start = rank * self.rows_per_rank
        full = _full
        if full is None:  # nn.Embedding's initialisation, on the full table
            full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            if full.device.type != "meta":
                nn.init.normal_(full)
                if padding_idx is not None:
                    with torch.no_grad():
                        full[padding_idx].zero_()
        pad = full.new_zeros(self.padded_num_embeddings - num_embeddings, embedding_dim)
        self.weight = sharded_parameter(torch.cat([full.detach(), pad]), 0, tp, rank, logical_rows=num_embeddings)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding expects integer ids (torch.int64 or torch.int32), got "
                            f"{ids.dtype}")
        _assert_on_device(ids, lambda: (ids >= 0) & (ids < self.num_embeddings),
                          f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings})")
        if ids.device.type == "cpu" and ids.numel() and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise TokenIdError(f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings}), got values in "
                             f"[{ids.min().item()}, {ids.max().item()}]")
        local_pad = self._local_padding_idx()
        if comm.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight, local_pad)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.partial_output:
            return out
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(out, self.tp_group)
        return comm.reduce_from_tp(out, self.tp_group)

    def _local_padding_idx(self) -> int | None:
        """The padding row's index among this rank's rows; None where another rank holds it."""
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.rows_per_rank:
            return self.padding_idx - self.vocab_start
        return None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> VocabParallelEmbedding:
        """Shard an existing nn.Embedding (weights copied; its padding_idx kept). A subclass with
        its own forward keeps it (Note [nn.Embedding subclasses])."""
        if problem := subclass_problem(embedding):
            raise ValueError(problem)
        layer = keep_requires_grad(cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                                       _full=embedding.weight.detach(), **kwargs), embedding)
        if type(embedding).forward is not nn.Embedding.forward:
            _keep_own_forward(layer, embedding)
        return layer

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local {self.rows_per_rank}), "
                f"{self.embedding_dim}, tp={comm.group_size(self.tp_group)}, sequence_parallel={self.sequence_parallel}"
                + (", partial_output=True" if self.partial_output else ""))


# Note [nn.Embedding subclasses]: some models' embeddings subclass nn.Embedding and do more in
# their own forward than the lookup: transformers' Gemma, Gemma 2 and Gemma 3 multiply the rows
# by sqrt(hidden) (`super().forward(ids) * self.embed_scale`). A VocabParallelEmbedding in its
# place would drop that forward: at tp=2 an untied Gemma's logits were 0.47 (relative) from the
# plain model's before any step, and training went on without an error. So the sharded layer of
# such a module is an instance of a class made for it, VocabParallel<Name>(<Name>, _Lookup):
# the subclass's forward runs as written, and its `super().forward(ids)` - which resolves to
# nn.Embedding.forward in the plain model - reaches _Lookup (the class order puts it between
# the subclass and nn.Embedding), the vocabulary-parallel lookup, whose rows are already summed
# over tp (or reduce-scattered) when the subclass's own math sees them. The subclass's buffers
# (embed_scale) and plain attributes come along; parameters besides the weight and submodules
# are refused (supporting them would mean deciding, per subclass, how their gradients add up
# over tp). A subclass forward that indexes self.weight itself instead of calling
# nn.Embedding.forward reads the shard with global ids: it fails on its first call, with an
# IndexError where an id falls outside this rank's rows (a device-side assert on CUDA), else
# with the check after the call that the lookup ran. The layer is an nn.Embedding now, and code
# written for one (nn.Embedding.reset_parameters, transformers' _init_weights zeroing
# weight[padding_idx]) sees its local table: its padding_idx is the padding row's local index,
# None on the ranks that do not hold it.
class _Lookup(VocabParallelEmbedding, nn.Embedding):
    """The vocabulary-parallel lookup where an nn.Embedding subclass's super().forward lands."""

    def forward(self, ids: Tensor) -> Tensor:
        self._pl_looked_up = True
        return VocabParallelEmbedding.forward(self, ids)

    def _local_padding_idx(self) -> int | None:
        return self.padding_idx  # already local (see the Note)


def subclass_problem(embedding: nn.Embedding) -> str | None:
    """Why VocabParallel() cannot take this nn.Embedding subclass, or None (Note [nn.Embedding
    subclasses]); parallelize asks before it converts anything."""
    cls = type(embedding)
    if cls.forward is nn.Embedding.forward:
        return None
    extra = [n for n, _ in embedding.named_parameters(recurse=False) if n != "weight"]
    if not extra and not embedding._modules:
        return None
    held = f"parameters {extra}" if extra else f"submodules {list(embedding._modules)}"
    return (f"VocabParallelEmbedding: {cls.__name__} has its own forward and holds {held} besides its weight; keep "
            "this embedding replicated (leave it out of the plan): VocabParallel() takes an nn.Embedding subclass "
            "whose only parameter is its weight")


_SUBCLASS_LAYERS: dict[type, type] = {}


def _keep_own_forward(layer: VocabParallelEmbedding, embedding: nn.Embedding) -> None:
    """Make `layer` (just sharded from `embedding`) run embedding's own forward around the
    vocabulary-parallel lookup (Note [nn.Embedding subclasses])."""
    cls = type(embedding)
    if cls not in _SUBCLASS_LAYERS:
        own_forward = cls.forward

        def forward(self, *args, **kwargs):
            self._pl_looked_up = False
            out = own_forward(self, *args, **kwargs)
            if not self._pl_looked_up:
                raise RuntimeError(f"{cls.__name__}.forward does not call nn.Embedding.forward (super().forward), "
                                   "so its vocabulary-parallel shard would be indexed with global ids; keep this "
                                   "embedding replicated (leave it out of the plan)")
            return out

        _SUBCLASS_LAYERS[cls] = type(f"VocabParallel{cls.__name__}", (cls, _Lookup), {"forward": forward})
    state = {k: v for k, v in vars(embedding).items() if not k.startswith("_") and k not in vars(layer)}
    layer.padding_idx = layer._local_padding_idx()  # before the class changes what that returns
    layer.__class__ = _SUBCLASS_LAYERS[cls]
    vars(layer).update(state)
    for name, buf in embedding.named_buffers(recurse=False):
        layer.register_buffer(name, buf, persistent=name not in embedding._non_persistent_buffers_set)


def vocab_parallel_logits(hidden: Tensor, embedding: VocabParallelEmbedding) -> Tensor:
    """Local logits [..., V_r] of a head tied to `embedding`.

    hidden is replicated over TP (copy-to-TP: its gradient is all-reduced), or, when the
    embedding is sequence parallel, sharded on dim 0 (all-gathered here; its gradient is
    reduce-scattered), like the input of a column-parallel layer.
    """
    if embedding.sequence_parallel:
        hidden = comm.gather_from_sp(hidden, embedding.tp_group)
    else:
        hidden = comm.copy_to_tp(hidden, embedding.tp_group)
    return F.linear(hidden, embedding.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, vocab_start, ignore_index, group):
        ctx.dtype = logits.dtype
        logits = logits.float()
        rows = logits.shape[-1]
        padded = torch.arange(vocab_start, vocab_start + rows, device=logits.device) >= vocab_size
        if padded.any():  # padding rows of the vocabulary never win and never count
            logits = logits.masked_fill(padded, float("-inf"))
        max_logit = logits.max(dim=-1).values
        if comm.group_size(group) > 1:
            comm.check_agreement("all_reduce(max)", max_logit, group)
            with fault.collective("vocab-parallel cross-entropy all_reduce(max)", group):
                dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < rows)
        local_t = local_t.clamp(0, rows - 1)
        # where, not a product: on a rank whose rows are all padding every shifted logit is -inf,
        # and -inf * 0 was NaN in every rank's loss (review finding: a vocabulary of 5 at tp=4)
        target_logit = torch.where(mine, shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        if comm.group_size(group) > 1:
            comm.all_reduce(sums, group)
        sum_exp, target_logit = sums
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: Tensor, target: Tensor, embedding_or_vocab: VocabParallelEmbedding,
                                 *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """F.cross_entropy over logits split on the vocabulary, without gathering them.

    local_logits [..., V_r] (from `vocab_parallel_logits`), target [...] global ids or
    ignore_index. reduction: "mean" over non-ignored targets, "sum" or "none".
    """
    emb = embedding_or_vocab
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not all(hasattr(emb, a) for a in ("rows_per_rank", "num_embeddings", "vocab_start", "tp_group")):
        raise TypeError(f"vocab_parallel_cross_entropy needs the VocabParallelEmbedding whose weight produced the "
                        f"logits (for its vocabulary split), got {type(emb).__name__}")
    if local_logits.shape[:-1] != target.shape or local_logits.shape[-1] != emb.rows_per_rank:
        raise ValueError(f"local logits {tuple(local_logits.shape)} and target {tuple(target.shape)} do not match: "
                         f"expected logits [*target.shape, {emb.rows_per_rank}]")
    if target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vocab_parallel_cross_entropy expects integer targets (torch.int64 or torch.int32), got "
                        f"{target.dtype}")
    # A target outside the vocabulary would match no rank's rows and count as logit 0, silently.
    # On the CPU the error names the values; the targets are replicated over the TP group, so
    # every rank of it raises together. On a GPU, Note [range checks on a device].
    _assert_on_device(target, lambda: ((target >= 0) & (target < emb.num_embeddings)) | (target == ignore_index),
                      f"vocab_parallel_cross_entropy: targets must be in [0, {emb.num_embeddings}) or ignore_index "
                      f"({ignore_index})")
    if target.device.type == "cpu":
        counted = target[target != ignore_index]
        if counted.numel() and (counted.min() < 0 or counted.max() >= emb.num_embeddings):
            raise IndexError(f"vocab_parallel_cross_entropy: targets must be in [0, {emb.num_embeddings}) or "
                             f"ignore_index ({ignore_index}), got values in [{counted.min().item()}, "
                             f"{counted.max().item()}]")
    loss = _VocabParallelCrossEntropy.apply(local_logits, target, emb.num_embeddings, emb.vocab_start,
                                            ignore_index, emb.tp_group)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp_min(1)


# Note [range checks on a device]: an id or a target outside the vocabulary matches no rank's
# rows: the lookup returns zeros and the loss counts the target's logit as 0, a silently wrong
# step. On the CPU the check raises an error naming the values; on a GPU reading them back would
# stall the host every step, so the check is an asynchronous device-side assert
# (torch._assert_async, CUDA only): no sync, a few elementwise kernels, and the job stops at its
# next sync with a CUDA "device-side assert triggered" error carrying the message - what torch's
# own nn.Embedding and F.cross_entropy do on a GPU.
def _assert_on_device(values: Tensor, valid: Callable[[], Tensor], message: str) -> None:
    """On a CUDA device, every element of `valid()` true, asserted without a sync (Note [range
    checks on a device]; torch has the assert's kernel for CUDA and the CPU only). The CPU's
    values are checked by the caller, with an error that names them."""
    if values.device.type == "cuda" and values.numel():
        assert_async(valid().all(), message)


# Note [vocab-parallel head]: a head tied to the input embedding reads the embedding module
# itself (not a copy of its weight) through `tied_logits` / `tied_cross_entropy`. The plan style
# VocabParallel() replaces that one module everywhere the model holds it, so the head and the
# embedding stay tied (one parameter; under a pipeline, PipelineStages' Note [tied parameters]),
# and the head's logits and loss become vocabulary-parallel with no change to the model code.
def tied_logits(hidden: Tensor, embedding: nn.Module) -> Tensor:
    """Logits of a head tied to `embedding`: [..., D] -> [..., V], or the local [..., V_r] when
    `embedding` is a VocabParallelEmbedding (Note [vocab-parallel head])."""
    if isinstance(embedding, VocabParallelEmbedding):
        return vocab_parallel_logits(hidden, embedding)
    return F.linear(hidden, embedding.weight)


def tied_cross_entropy(logits: Tensor, target: Tensor, embedding: nn.Module, *, ignore_index: int = -100,
                       reduction: str = "mean") -> Tensor:
    """Cross-entropy of `tied_logits`' output against global targets [...]: F.cross_entropy (in
    float32, as the vocabulary-parallel one computes), or `vocab_parallel_cross_entropy` when
    `embedding` is a VocabParallelEmbedding (Note [vocab-parallel head])."""
    if isinstance(embedding, VocabParallelEmbedding):
        return vocab_parallel_cross_entropy(logits, target, embedding, ignore_index=ignore_index, reduction=reduction)
    loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index,
                           reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss
