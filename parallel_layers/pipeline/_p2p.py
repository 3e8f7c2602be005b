"""Point-to-point messages between pipeline stages: each schedule batch is one `batch_isend_irecv`.

The schedule decides which sends and receives go together and in which order (Note [p2p
rounds] in schedule.py); this file turns one batch into one `dist.batch_isend_irecv` call
(a ncclGroupStart/End under NCCL) and keeps the shape contract. No tags are used: like NCCL,
gloo then matches each pair's messages in issue order, so the CPU tests run the order NCCL
will see. (A first `batch_isend_irecv` on a group must involve all its ranks under NCCL; the
step's batch-size all-gather on the pipeline group always comes first.)

Note [stage boundary contract]: a receiver must allocate an activation's buffer before it
arrives, so it has to know the shape and dtype. They are learned once per input signature
(rank 0's input shape and dtype, which every pipeline rank receives in the step's batch-size
all-gather): in the first step with a new signature, the first activation of each boundary is
preceded by a small int64 header (ndim, dtype, shape) in a batch of its own, which the
receiver reads before it issues the payload's batch. The contracts are kept for the
signature once a step succeeds on every rank, so later steps send every activation as a
single message: one operation per transfer, no header, no host synchronisation. A stage
whose output does not match the contract (a shape that changed between microbatches, or a
model whose shapes depend on more than the input shape) is caught by its sender, which
sends zeros of the agreed shape instead, so that every pair's messages still match, and
records the error; the step ends with one all-reduce that carries every rank's error flag
with the loss, and every pipeline rank raises the same message. Gradients need no header:
a gradient has the shape of the activation it belongs to, which the receiver kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault

_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype index, dims; ndim -1: the output cannot be described
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_SIGNATURES_KEPT = 16


def describe_problem(t: Tensor) -> str | None:
    """Why `t` cannot cross a stage boundary, or None."""
    if t.dim() > _MAX_DIMS:
        return f"a stage output has {t.dim()} dims; the pipeline sends at most {_MAX_DIMS}"
    if t.dtype not in _DTYPES:
        return f"a stage output has dtype {t.dtype}; the pipeline sends {_DTYPES}"
    return None


def signature(t: Tensor | None) -> list[int]:
    """A tensor's shape and dtype as _HEADER int64s (all -1 for None)."""
    h = [-1] * _HEADER
    if t is not None:
        h[0], h[1] = t.dim(), _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
        h[2:2 + min(t.dim(), _MAX_DIMS)] = list(t.shape)[:_MAX_DIMS]
    return h


def mismatch_message(stage: int, microbatch: int, got: tuple, expected: tuple, remembered: bool = False) -> str:
    where = "an earlier step with inputs of this shape" if remembered else "this step"
    return (f"pipeline stage {stage} produced {got[0]} {got[1]} for microbatch {microbatch}, but microbatch 0 of "
            f"{where} produced {expected[0]} {expected[1]}: every microbatch must cross a stage boundary with the "
            "same shape and dtype (split the batch evenly; keep sequence lengths equal within a step; a stage's "
            "output shape must follow from the shape of the pipeline's inputs)")


class Messenger:
    """The sends and receives of a pipeline's steps on `group`, for `device` tensors."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self._known: dict[tuple, dict[int, tuple]] = {}  # input signature -> {stage: (shape, dtype)}

    def begin(self, input_signature: tuple) -> None:
        """Start a step whose inputs have `input_signature` (the same on every pipeline rank)."""
        self.input_signature = input_signature
        self.contract = dict(self._known.get(input_signature, {}))  # stage -> (shape, dtype) of its output
        self.error: str | None = None  # the first broken contract this step, reported at its end
        self.received: dict[tuple, tuple] = {}  # item -> (works, buffer)
        self.in_flight: list = []  # (works, tensors) of sends, kept alive until they complete

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def outgoing(self, stage: int, microbatch: int, y: Tensor) -> tuple[Tensor, bool]:
        """What to send for stage `stage`'s output y, and whether y broke the contract (then
        zeros of the agreed shape go out instead and the error waits for the step's end)."""
        expected = self.contract.get(stage)
        got = (tuple(y.shape), y.dtype)
        if expected is None or got == expected:
            return y.detach(), False
        self.error = self.error or mismatch_message(stage, microbatch, got, expected,
                                                    remembered=stage in self._known.get(self.input_signature, {}))
        return torch.zeros(expected[0], dtype=expected[1], device=self.device), True

    def exchange(self, sends: list[tuple[tuple, Tensor, int]], recvs: list[tuple[tuple, int, tuple | None]]) -> None:
        """Issue one batch: `sends` are (item, tensor, peer), `recvs` (item, peer, (shape, dtype)
        or None for an activation, whose shape the contract gives). Items are ("act" | "grad",
        stage, microbatch), in the schedule's order, which both ends share."""
        first = [(it, t, peer) for it, t, peer in sends if it[0] == "act" and it[1] not in self.contract]
        first_in = [(it, peer) for it, peer, like in recvs if like is None and it[1] not in self.contract]
        announced = self._headers(first, first_in) if first or first_in else {}
        ops, keep, posted = [], [], []
        for it, t, peer in sends:
            t = t.contiguous()
            keep.append(t)
            ops.append(dist.P2POp(dist.isend, t, self._peer(peer), self.group))
        for it, peer, like in recvs:
            shape, dtype = like or announced.get(it) or self.contract[it[1]]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(peer), self.group))
            posted.append((it, buf, len(ops) - 1))
        works = self._launch(ops)
        # NCCL returns one work for a whole coalesced batch, gloo one per operation.
        per_op = (lambda j: [works[j]]) if len(works) == len(ops) else (lambda j: works)
        for it, buf, j in posted:
            self.received[it] = (per_op(j), buf)
        # A gloo receive's work may be waited only once (in `wait`): keep the sends' own.
        self.in_flight.append((works[:len(sends)] if len(works) == len(ops) else works if sends else [], keep))

    def _launch(self, ops: list) -> list:
        with fault.collective("pipeline send/receive batch", self.group, point_to_point=True):
            return dist.batch_isend_irecv(ops) or []

    def _headers(self, sends: list, recvs: list) -> dict[tuple, tuple]:
        """Note [stage boundary contract]: the first activations of a boundary in a step with a
        new input signature; both ends issue this batch at the same point of their lists.
        Returns the (shape, dtype) announced for each received item."""
        ops, out, problem = [], [], None
        for it, t, peer in sends:
            problem = problem or describe_problem(t)
            h = torch.tensor(signature(t) if describe_problem(t) is None else [-1] * _HEADER, dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, h.to(self.device), self._peer(peer), self.group))
            self._agree(it, (tuple(t.shape), t.dtype))
        for it, peer in recvs:
            h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, h, self._peer(peer), self.group))
            out.append((it, h))
        for w in self._launch(ops):
            fault.wait(w, "pipeline activation header", self.group, point_to_point=True)
        if problem is not None:
            raise ValueError(problem)
        announced = {}
        for it, h in out:
            h = h.cpu().tolist()
            if h[0] < 0:
                raise ValueError(f"pipeline stage {it[1]}'s output cannot cross a stage boundary (its sender raised "
                                 f"why: too many dims, or a dtype outside {_DTYPES})")
            announced[it] = (tuple(h[2:2 + h[0]]), _DTYPES[h[1]])
            self._agree(it, announced[it])
        return announced

    def _agree(self, item: tuple, got: tuple) -> None:
        """The first announced shape of a stage's output is its contract for the step."""
        expected = self.contract.setdefault(item[1], got)
        if got != expected:
            self.error = self.error or mismatch_message(item[1], item[2], got, expected)

    def wait(self, item: tuple) -> Tensor:
        """The received tensor of `item` (a schedule batch issued its receive earlier)."""
        works, buf = self.received.pop(item)
        kind, stage, mb = item
        for w in works:
            fault.wait(w, f"receive of stage {stage}'s {'activation' if kind == 'act' else 'gradient'} "
                          f"(microbatch {mb})", self.group, point_to_point=True)
        return buf

    def finish(self, succeeded: bool) -> None:
        """Wait for the step's sends (their buffers may be reused after); keep the contracts
        learned for this input signature if the step succeeded on every pipeline rank."""
        for works, _ in self.in_flight:
            for w in works:
                fault.wait(w, "pipeline send", self.group, point_to_point=True)
        self.in_flight.clear()
        if succeeded:
            self._known.pop(self.input_signature, None)
            self._known[self.input_signature] = self.contract
            while len(self._known) > _SIGNATURES_KEPT:
                self._known.pop(next(iter(self._known)))
