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

Note [a failed stage]: a stage's forward or backward that raises (a refusal inside the model,
a stage returning something other than a tensor, an output that cannot be sent) would leave
its peers blocked on a message that never comes. The step runs on instead, like a broken
contract: the failing rank records the error and keeps every message its peers expect. If the
boundary's contract is known, zeros of the agreed shape go out (an input gradient that cannot
be computed goes out as zeros of the input's shape); if it is not (the boundary's first
activation of a step with a new signature), the header says "no output" (ndim -1), and both
ends then drop the boundary's remaining activations and their gradients for the step - the
receiver skips the forwards they would feed, so their own outputs are missing too and the
next boundary is dropped the same way, down the pipe. The step's closing all-reduce then
carries the error flag to every rank, each raises: the failing rank its own exception, the
others a RuntimeError that names the rank, the stage and the message. The rank's state is
clean after it (every posted receive waited for, no contract kept), so the next step can run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault

_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype index, dims; ndim -1: no output follows (Note [a failed stage])
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
        self.error: str | None = None  # the first broken contract or failure this step, reported at its end
        self.exception: BaseException | None = None  # this rank's own failure, re-raised at the end
        self.dropped: set[int] = set()  # stages whose output does not cross the boundary this step
        self.received: dict[tuple, tuple] = {}  # item -> (works, buffer)
        self.in_flight: list = []  # (works, tensors) of sends, kept alive until they complete

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def fail(self, message: str, exception: BaseException | None = None) -> None:
        """Record a failure of this rank's step, raised on every pipeline rank at its end."""
        if self.error is None:
            self.error, self.exception = message, exception

    def is_dropped(self, item: tuple) -> bool:
        """Does `item` not travel this step (Note [a failed stage])? An activation of a dropped
        boundary, or the gradient sent back over it."""
        kind, stage, _ = item
        return (stage if kind == "act" else stage - 1) in self.dropped

    def outgoing(self, stage: int, microbatch: int, y: Tensor | None) -> tuple[Tensor | None, bool]:
        """What to send for stage `stage`'s output y (None: the stage failed, Note [a failed
        stage]), and whether y broke the contract (then zeros of the agreed shape go out
        instead and the error waits for the step's end). None out: the header will say so."""
        expected = self.contract.get(stage)
        if y is None:
            if expected is None:
                return None, True
            return torch.zeros(expected[0], dtype=expected[1], device=self.device), True
        got = (tuple(y.shape), y.dtype)
        if expected is None or got == expected:
            return y.detach(), False
        self.fail(mismatch_message(stage, microbatch, got, expected,
                                   remembered=stage in self._known.get(self.input_signature, {})))
        return torch.zeros(expected[0], dtype=expected[1], device=self.device), True

    def exchange(self, sends: list[tuple[tuple, Tensor, int]], recvs: list[tuple[tuple, int, tuple | None]]) -> None:
        """Issue one batch: `sends` are (item, tensor, peer), `recvs` (item, peer, (shape, dtype)
        or None for an activation, whose shape the contract gives). Items are ("act" | "grad",
        stage, microbatch), in the schedule's order, which both ends share."""
        sends = [s for s in sends if not self.is_dropped(s[0])]
        recvs = [r for r in recvs if not self.is_dropped(r[0])]
        first = [(it, t, peer) for it, t, peer in sends if it[0] == "act" and it[1] not in self.contract]
        first_in = [(it, peer) for it, peer, like in recvs if like is None and it[1] not in self.contract]
        announced = self._headers(first, first_in) if first or first_in else {}
        sends = [s for s in sends if not self.is_dropped(s[0])]  # the headers may have dropped a boundary
        recvs = [r for r in recvs if not self.is_dropped(r[0])]
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
        if not ops:  # everything of this batch was dropped (Note [a failed stage])
            return []
        with fault.collective("pipeline send/receive batch", self.group, point_to_point=True):
            return dist.batch_isend_irecv(ops) or []

    def _headers(self, sends: list, recvs: list) -> dict[tuple, tuple]:
        """Note [stage boundary contract]: the first activations of a boundary in a step with a
        new input signature; both ends issue this batch at the same point of their lists.
        Returns the (shape, dtype) announced for each received item."""
        ops, out = [], []
        for it, t, peer in sends:
            problem = describe_problem(t) if t is not None else None
            if problem is not None:
                self.fail(problem)
            if t is None or problem is not None:  # no output follows (Note [a failed stage])
                self.dropped.add(it[1])
                h = torch.full((_HEADER,), -1, dtype=torch.int64)
            else:
                h = torch.tensor(signature(t), dtype=torch.int64)
                self._agree(it, (tuple(t.shape), t.dtype))
            ops.append(dist.P2POp(dist.isend, h.to(self.device), self._peer(peer), self.group))
        for it, peer in recvs:
            h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, h, self._peer(peer), self.group))
            out.append((it, h))
        for w in self._launch(ops):
            fault.wait(w, "pipeline activation header", self.group, point_to_point=True)
        announced = {}
        for it, h in out:
            h = h.cpu().tolist()
            if h[0] < 0:  # the sender's stage failed; its error reaches every rank at the step's end
                self.dropped.add(it[1])
                continue
            announced[it] = (tuple(h[2:2 + h[0]]), _DTYPES[h[1]])
            self._agree(it, announced[it])
        return announced

    def _agree(self, item: tuple, got: tuple) -> None:
        """The first announced shape of a stage's output is its contract for the step."""
        expected = self.contract.setdefault(item[1], got)
        if got != expected:
            self.fail(mismatch_message(item[1], item[2], got, expected))

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
