"""Token ids checked against the input embedding before a step (Note [token ids in range])."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

# Note [token ids in range]: a transformers model's nn.Embedding given an id outside its table
# raises "IndexError: index out of range in self", naming neither the value nor the table's size,
# and a float tensor of ids an error about argument #1 'indices' (review finding, helper-76, at
# dp=2 and pp=2). The step checks the ids first, as VocabParallelEmbedding does under tensor
# parallelism (tensor_parallel/vocab.py, which keeps its own check): on the CPU one min / max pass
# over the batch's ids, and an error naming them and the valid range; on a GPU a device-side
# assert with that message (Note [range checks on a device] there), since reading the values back
# would stall the host every step (its message names the range, not the values). Without a
# pipeline the refusal, or the device's flag, is reduced over the data-parallel replicas, so that
# every replica raises (the CPU) or stops at its next sync (a GPU; Note [a refusal on every
# replica] in _replica_refusal.py); under a pipeline rank 0's range travels in the batch check's
# all-gather and every pipeline rank raises it (pipeline/runtime.py). Every layout raises a
# TokenIdError, both an IndexError and a ValueError.


class TokenIdError(IndexError, ValueError):
    """Token ids outside the model's vocabulary (the inputs', or the labels' of a causal-LM
    loss): an IndexError, as nn.Embedding's, F.cross_entropy's and VocabParallelEmbedding's, and
    a ValueError, as the pipeline's batch refusals are, so that one `except` catches it at every
    layout (review finding, helper-77)."""


def token_ids_problem(vocab: int, low: int, high: int) -> str | None:
    """Why ids in [low, high] cannot index a table of `vocab` rows, or None."""
    if 0 <= low and high < vocab:
        return None
    return (f"token ids must be in [0, {vocab}) (the model's input embedding has {vocab} rows), got values in "
            f"[{low}, {high}]")


def input_vocab(model: nn.Module) -> int | None:
    """The rows of `model`'s input embedding (a transformers model's `get_input_embeddings()`, an
    nn.Embedding or a VocabParallelEmbedding, whose num_embeddings is the whole table's), or None
    for a model without one."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model of the user's own, or one without the accessor
        return None
    from parallel_layers.tensor_parallel.vocab import VocabParallelEmbedding  # it imports TokenIdError from here

    return embedding.num_embeddings if isinstance(embedding, (nn.Embedding, VocabParallelEmbedding)) else None


def check_token_ids(ids: Tensor, model: nn.Module) -> tuple[Tensor, str] | None:
    """Raise unless `ids` are integer ids within `model`'s input embedding (`input_vocab`): on the
    CPU naming the values; on a GPU returns a device flag of ids out of range and the message to
    assert it with, for the step to reduce over the data-parallel replicas first (Note [a refusal
    on every replica] in _replica_refusal.py). A VocabParallelEmbedding checks its ids too, on
    its TP group only."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"forward_backward needs token ids (an integer tensor, torch.int64) as the inputs of a "
                        f"transformers model; got {ids.dtype}")
    vocab = input_vocab(model)
    if vocab is None or not ids.numel():
        return None
    if ids.device.type == "cuda":
        return ((ids < 0) | (ids >= vocab)).any(), f"token ids must be in [0, {vocab})"
    low, high = (int(v) for v in torch.aminmax(ids))
    problem = token_ids_problem(vocab, low, high)
    if problem:
        raise TokenIdError(problem)
    return None


# Note [labels in range]: F.cross_entropy given a label outside the logits raises "IndexError:
# Target 130 is out of bounds." on the CPU (no range) and asserts on a GPU, on the rank given
# that batch only. For the causal-LM losses of parallel_layers.pipeline.hf the step knows what
# the loss reads - the labels after the first column, each in [0, vocab) or -100, vocab the
# input embedding's rows, as the ids' check and the pipeline's take it (a causal LM's head has as
# many; config.vocab_size, which a hand-edited config can leave stale, is not read: review
# finding, helper-81) - and checks
# them beside the inputs, so that the error names the values and is agreed over the replicas
# (Note [a refusal on every replica]); under a pipeline the last rank's range travels in the
# batch check's all-gather, as rank 0's ids do. A loss of the user's own is left to raise as it does.
def check_labels(labels: Tensor, vocab: int) -> tuple[Tensor, str] | None:
    """Raise (CPU) unless the labels a causal-LM loss reads (`labels[:, 1:]`) are -100 or in
    [0, vocab); on a GPU return their device flag and message, as `check_token_ids` does."""
    if not isinstance(labels, Tensor) or labels.dim() != 2 or labels.is_floating_point() or \
            labels.dtype == torch.bool or labels.shape[1] < 2 or not labels.numel():
        return None  # not a batch of label rows: the loss refuses it itself
    if labels.device.type == "cuda":
        read = labels[:, 1:]
        return ((read != -100) & ((read < 0) | (read >= vocab))).any(), f"labels must be in [0, {vocab}) or -100"
    low, high = (int(v) for v in labels_range(labels))
    problem = labels_problem(vocab, low, high)
    if problem:
        raise TokenIdError(problem)
    return None


def labels_range(labels: Tensor) -> Tensor:
    """The smallest and largest label a causal-LM loss reads (`labels[:, 1:]`, -100 aside), on
    the labels' device without a host sync; [0, -1] (high < low) when it reads none."""
    read = labels[:, 1:].to(torch.int64)
    ignored = read == -100
    big = torch.iinfo(torch.int64).max
    low, high = torch.where(ignored, big, read).amin(), torch.where(ignored, -big, read).amax()
    none = ignored.all()
    return torch.stack([torch.where(none, 0, low), torch.where(none, -1, high)])


def labels_problem(vocab: int, low: int, high: int) -> str | None:
    """Why labels in [low, high] (high < low: none read) do not fit a vocabulary of `vocab`, or None."""
    if high < low or (0 <= low and high < vocab):
        return None
    return (f"labels must be in [0, {vocab}) or -100 (ignored) for the causal-LM loss (the model's vocabulary has "
            f"{vocab} entries), got values in [{low}, {high}] (labels[:, 0] is not read)")


def reads_labels(labels, loss_fn) -> bool:
    """Whether `loss_fn` is a causal-LM loss whose labels the step checks (Note [labels in range]),
    and `labels` a batch of label rows it reads."""
    from parallel_layers.pipeline.hf import causal_lm_loss, causal_lm_loss_sum

    return (loss_fn in (causal_lm_loss, causal_lm_loss_sum) and isinstance(labels, Tensor) and labels.dim() == 2
            and not labels.is_floating_point() and not labels.is_complex() and labels.dtype != torch.bool
            and labels.shape[1] >= 2 and labels.numel() > 0)
