"""Every rank of a tensor-parallel group, and every pipeline rank, must be given the same batch.

Note [same batch check]: the ranks of a TP group compute one replica's step together, and the
pipeline ranks one replica's stages; only the data-parallel replicas take different rows. A
script that shards its data by the global rank - the habit DDP teaches - gives each rank of a TP
group other rows: each rank's shards then compute on other tokens, the all-reduces sum their
partial results, and the model trains on a mixture of both batches with no error (review
finding: losses 5.488 and 5.608 on the two TP ranks against the plain model's 5.506). Under a
pipeline, stage 0's inputs met the last stage's targets of other rows. So `parallelize`'s step
compares a digest of the batch over the TP group, and the pipeline over its ranks, before the
forward: a weighted sum of the tensors' words, each position weighted by a hash of it (weights
linear in the position missed two rows of equal sums swapped: review finding), and their element
count. Where every rank reads a tensor (a TP group), a rank given none where another was given
one differs too (review finding: position_ids on one TP rank only trained on); under a pipeline
a rank given no tensor is left out, and only what a rank's role reads is the reference - the inputs (and mask) of pipeline rank 0, the targets of the last - and another
rank's tensor is compared with it only when it has as many elements (a placeholder of another
size, or a mask a rank does not read, is not an error). A TP group under a pipeline is checked
by the pipeline, whose batch check carries a refusal to its other ranks. On the CPU a mismatch raises on every rank, naming the ranks; on a GPU the
comparison is a device-side assert (Note [range checks on a device] in tensor_parallel/vocab.py),
which costs no host sync: the job stops at its next sync. The cost is one all-gather of a few
numbers per step over the group, beside the many all-reduces a TP step makes anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault
from parallel_layers._device_assert import assert_async

_NONE, _NOT_TENSOR = -1, -2
_GOLDEN, _PRIME = 0x9E3779B1, 2**31 - 1  # a multiplicative hash of the position, in [1, 2^31)


def _scalar(value: int, device: torch.device) -> Tensor:
    """An int64 scalar on `device` by a fill: `torch.tensor(value, device="cuda")` copies from
    the host and synchronizes the stream (review finding, helper-74: 4-5 host syncs a step)."""
    return torch.full((), value, dtype=torch.int64, device=device)


def _digest(t, device: torch.device) -> list[Tensor]:
    if t is None:
        return [_scalar(_NONE, device)] * 2
    if not isinstance(t, Tensor):
        return [_scalar(_NOT_TENSOR, device)] * 2
    size = t.element_size()
    word = torch.int64 if size % 8 == 0 else torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 \
        else torch.uint8  # the tensor's bytes, read as whole words where they allow (ids: one int64 each)
    data = t.detach().contiguous().view(-1).view(word).to(device=device, dtype=torch.int64)
    weights = torch.arange(data.numel(), device=device, dtype=torch.int64) * _GOLDEN % _PRIME + 1
    return [(data * weights).sum(), _scalar(t.numel(), device)]


def device_message(what: str, ranks: Sequence[int]) -> str:
    """The device assert's message: the group's ranks named in short (Note [a device assert's
    message]), the hint in full."""
    return (f"the {what} ranks {_ranks_text(ranks)} were given different batches: shard the data by "
            "ctx.coordinate('dp'), not by the global rank")


def _ranks_text(ranks: Sequence[int]) -> str:
    """A group's ranks in a few characters (Note [a device assert's message])."""
    if len(ranks) <= 4:
        return str(list(ranks))
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}..{ranks[-1]}" + (f" (every {step}th)" if step > 1 else "")
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _device(group) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check(tensors: Sequence, names: Sequence[str], group, what: str,
          readers: Sequence[int | None] | None = None) -> None:
    """Raise on every rank of `group` (or assert on the device) unless the ranks given each of
    `tensors` were given the same one (Note [same batch check]). readers: per tensor, the group
    rank whose tensor is the reference (the rank that reads it); None: every rank reads it."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1 or \
            dist.get_backend(group) == "fake":  # the fake process group moves no data: nothing to compare
        return
    device = _device(group)
    mine = torch.stack([d for t in tensors for d in _digest(t, device)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with fault.collective(f"{what} same-batch check (all_gather)", group):
        dist.all_gather(every, mine, group=group)
    table = torch.stack(every).view(len(every), len(tensors), 2)  # [rank, tensor, (digest, numel)]
    # the reference of each tensor: its reader's, or the first rank's that was given one
    given = table[:, :, 1] >= 0
    first = torch.where(given, torch.arange(len(every), device=device)[:, None], len(every)).amin(0)
    reader = first.clamp(max=len(every) - 1)  # device tensors throughout: no host sync on a GPU
    if readers is not None:
        fixed = torch.stack([_scalar(-1 if r is None else r, device) for r in readers])
        reader = torch.where(fixed >= 0, fixed, reader)
    column = torch.arange(len(tensors), device=device)
    ref = table[reader, column]  # [tensor, 2]
    compared = given & given[reader, column][None, :] & (table[:, :, 1] == ref[:, 1])
    if readers is None:  # every rank reads it: another size is a difference too, and so is a tensor
        compared = torch.ones_like(given)  # given to some ranks only (a mask or positions on one TP rank)
    agree = (~compared | (table == ref[None]).all(-1)).all(0)  # [tensor]
    ranks = dist.get_process_group_ranks(group)
    if device.type == "cuda":
        assert_async(agree.all(), device_message(what, ranks))
        return
    hint = (f"every rank of a {what} group must be given the same batch (only the data-parallel replicas take "
            "different rows): shard the data by ctx.coordinate('dp'), not by the global rank")
    if bool(agree.all()):
        return
    differ = []
    for k, name in enumerate(names):
        if not bool(agree[k]):
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(ranks):
                if bool(compared[i, k]):
                    groups.setdefault(tuple(table[i, k].tolist()), []).append(r)
            differ.append(f"{name}: " + " vs ".join(f"ranks {rs}" for rs in groups.values()))
    raise ValueError(f"the {what} ranks {ranks} were given different batches ({'; '.join(differ)}): {hint}")
