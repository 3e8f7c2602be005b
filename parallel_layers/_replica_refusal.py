"""A batch one data-parallel replica refuses is refused by every replica.

Note [a refusal on every replica]: the data-parallel replicas take different rows, so a batch
check (token ids outside the embedding, a mask of the wrong shape, a tokenizer's dict for the
inputs) can fail on one replica only. Raised there alone, it left the other replicas in the
step's next collective (the gradient all-reduce, ZeRO-3's first all-gather) until the watchdog
or the process group's timeout reported it; and a script that caught it and skipped the batch
left that replica a step ahead of the others, whose collectives then matched in kind and size
and averaged gradients of two steps' batches, silently. So a step's checks end in one all-reduce
of a refusal flag over the data-parallel group, and every replica raises when any refused:

- the refusing rank its own exception;
- the others, where the flag is read on the host (the CPU, and a pipeline, whose batch check
  reads its sizes back anyway), the same kind of exception (so that one `except` skips the batch
  on every replica) with the refusing replica's message, gathered only on a refusal;
- on a GPU without a pipeline, a device-side assert on the reduced flag (Note [range checks on a
  device] in tensor_parallel/vocab.py): no host sync a step, and the job stops on every rank at
  its next sync - the refusing rank too, which raises its exception first: there the batch cannot
  be caught and skipped, since its peers have stopped. Token ids are checked on the device there, so their flag joins the all-reduce
  rather than asserting on its own rank, which would stop that rank before the collective and
  leave the others waiting in it.

The cost is one all-reduce of two numbers over dp per step: 0.3 ms on this project's 2-core CPU
over gloo (helper-78: +0.2-0.3 ms on a 10 ms step of a tiny Llama at dp=2; the benchmark steps
take hundreds of milliseconds), one small NCCL all-reduce on a GPU. An evaluation agrees only
where it is a collective over dp anyway - ZeRO-3's gathers, token_count's divisor, expert
parallelism's all-to-alls (Note [evaluation on one replica] in pipeline/runtime.py): else one
replica may evaluate while the others train, and raises alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault
from parallel_layers._device_assert import assert_async
from parallel_layers._same_batch import _device, _scalar
from parallel_layers._token_ids import TokenIdError

# the kinds a batch check raises; a peer raises the refusing replica's kind (the nearest of them)
_KINDS = {k.__name__: k for k in (TokenIdError, TypeError, ValueError, IndexError)}


def _on_device(device: torch.device, sync: bool) -> bool:
    """The peers assert on the device (a GPU group, sync=False) rather than read the flag back."""
    return device.type == "cuda" and not sync


def replicas(group) -> int:
    """How many data-parallel replicas must agree over `group` (1: none to agree with)."""
    if group is None or not dist.is_initialized() or dist.get_backend(group) == "fake":
        return 1
    return dist.get_world_size(group)


def refuse_together(refused: Exception | None, group, *, flagged: Tensor | None = None, flagged_message: str = "",
                    sync: bool = True) -> None:
    """Raise `refused` (this rank's batch check) here and a refusal on every other rank of the
    data-parallel `group`, or return when no replica refused (Note [a refusal on every replica]).
    flagged: a device-side flag of a problem checked there (token ids), asserted with
    `flagged_message` over the group. sync=False: on a GPU group, the peers assert on the device
    instead of reading the flag back."""
    n = replicas(group)
    if n == 1:
        if flagged is not None:
            assert_async(~flagged, flagged_message)
        if refused is not None:
            raise refused
        return
    device = _device(group)
    flags = torch.stack([_scalar(int(refused is not None), device),
                         flagged.to(device, torch.int64) if flagged is not None else _scalar(0, device)])
    with fault.collective("data-parallel batch check (all_reduce)", group):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if _on_device(device, sync):
        # the refusing rank asserts too: caught and skipped there, its next step would wait for
        # peers the assert stopped (review finding, helper-83)
        assert_async(flags[0] == 0, "a data-parallel replica refused its batch (its rank raised the reason); "
                                    "every replica stops")
        assert_async(flags[1] == 0, f"{flagged_message} on a data-parallel replica; every replica stops")
        if refused is not None:
            raise refused
        return
    refusing, bad_on_device = (bool(v) for v in flags.tolist())
    if bad_on_device:  # a device flag read back: only a CUDA batch over a gloo group
        refused = refused or (TokenIdError(flagged_message) if flagged is not None and bool(flagged) else None)
    if refusing or bad_on_device:
        # the nearest kind a peer can raise (a TypeError's subclass is caught as a TypeError there too)
        kind = next((k.__name__ for k in type(refused).__mro__ if _KINDS.get(k.__name__) is k), "ValueError")
        mine = (kind, str(refused)) if refused is not None else None
        found: list = [None] * n
        with fault.collective("data-parallel batch check (all_gather_object)", group):
            dist.all_gather_object(found, mine, group=group)
        if refused is None:
            replica, (kind, text) = next((i, e) for i, e in enumerate(found) if e is not None)
            raise _KINDS.get(kind, ValueError)(f"data-parallel replica {replica}'s batch was refused: {text}")
    if refused is not None:
        raise refused
