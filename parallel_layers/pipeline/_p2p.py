"""Point-to-point messages between pipeline stages: activations with a shape header, gradients.

Note [stage boundary contract]: an activation travels as a small int64 header (ndim, dtype,
shape) and then the payload. The first microbatch of a step fixes the boundary's shape and
dtype (so the sequence length may change between steps, not within one); every later
microbatch is checked against it on both sides: the sender raises before sending a wrong
payload and sends only the header, the receiver reads the header before the payload and
raises the same message. Gradients need no header: a gradient has the shape of the
activation it belongs to, which the receiver kept.

Every message carries a tag naming what it is (kind, stage, microbatch), so gloo matches it
whatever the order; NCCL ignores tags and matches in issue order, which `validate(...,
in_order=True)` checks for the schedule before it runs.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault

_MAX_DIMS = 8
_HEADER_WAIT_S = 10.0
_HEADER = 2 + _MAX_DIMS  # ndim, dtype index, dims
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]


def tag(kind: int, stage: int, microbatch: int, num_stages: int, part: int = 0) -> int:
    """kind 0: activation, 1: gradient; part 0: header, 1: payload."""
    return ((microbatch * num_stages + stage) * 2 + kind) * 2 + part


def header(t: Tensor) -> Tensor:
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"a stage output has {t.dim()} dims; the pipeline sends at most {_MAX_DIMS}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"a stage output has dtype {t.dtype}; the pipeline sends {_DTYPES}")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = t.dim(), _DTYPES.index(t.dtype)
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def describe(h: Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    ndim = int(h[0])
    return tuple(int(x) for x in h[2:2 + ndim]), _DTYPES[int(h[1])]


def mismatch_message(stage: int, microbatch: int, got: tuple, expected: tuple) -> str:
    return (f"pipeline stage {stage} produced {got[0]} {got[1]} for microbatch {microbatch}, but microbatch 0 of this "
            f"step produced {expected[0]} {expected[1]}: every microbatch must cross a stage boundary with the same "
            "shape and dtype (split the batch evenly; keep sequence lengths equal within a step)")


class Messenger:
    """Sends and receives of one pipeline step on `group`, for `device` tensors."""

    def __init__(self, group: dist.ProcessGroup | None, num_stages: int, device: torch.device):
        self.group, self.num_stages, self.device = group, num_stages, device
        self.contract: dict[int, tuple] = {}  # stage -> (shape, dtype) of its output this step
        self.pending: list = []  # (work, tensor kept alive until the send completes)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _isend(self, t: Tensor, peer: int, tag_: int) -> None:
        t = t.contiguous()
        self.pending.append((dist.isend(t, self._global(peer), group=self.group, tag=tag_), t))

    def _irecv(self, t: Tensor, peer: int, tag_: int):
        return dist.irecv(t, self._global(peer), group=self.group, tag=tag_), t

    def send_activation(self, y: Tensor, stage: int, microbatch: int, peer: int) -> None:
        h = header(y)
        got = (tuple(y.shape), y.dtype)
        expected = self.contract.setdefault(stage, got)
        self._isend(h.to(self.device), peer, tag(0, stage, microbatch, self.num_stages, 0))
        if got != expected:
            # Let the header reach the receiver, which then raises the same error, before this
            # rank raises (and perhaps exits, closing the connection under the message).
            with contextlib.suppress(RuntimeError):
                self.pending[-1][0].wait(datetime.timedelta(seconds=_HEADER_WAIT_S))
            raise ValueError(mismatch_message(stage, microbatch, got, expected))
        self._isend(y.detach(), peer, tag(0, stage, microbatch, self.num_stages, 1))

    # A receive is posted early (`post_*`, while the rank still computes) and waited on when
    # its data is needed (`wait`), so the message latency hides behind compute.
    def post_activation(self, stage: int, microbatch: int, peer: int) -> dict:
        """Post the header's receive, and the payload's when this boundary's contract is known."""
        h = {"kind": 0, "stage": stage, "mb": microbatch, "peer": peer,
             "what": f"receive of stage {stage}'s activation (microbatch {microbatch}) from pipeline rank {peer}",
             "header": self._irecv(torch.empty(_HEADER, dtype=torch.int64, device=self.device), peer,
                                   tag(0, stage, microbatch, self.num_stages, 0))}
        if stage in self.contract:
            shape, dtype = self.contract[stage]
            h["payload"] = self._irecv(torch.empty(shape, dtype=dtype, device=self.device), peer,
                                       tag(0, stage, microbatch, self.num_stages, 1))
        return h

    def post_gradient(self, like: Tensor, stage: int, microbatch: int, peer: int) -> dict:
        buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return {"kind": 1, "payload": self._irecv(buf, peer, tag(1, stage, microbatch, self.num_stages, 1)),
                "what": f"receive of stage {stage}'s gradient (microbatch {microbatch}) from pipeline rank {peer}"}

    def wait(self, h: dict) -> Tensor:
        if h["kind"] == 0:
            work, buf = h["header"]
            fault.wait(work, f"receive of stage {h['stage']}'s activation header", self.group)
            got = describe(buf.cpu())
            expected = self.contract.setdefault(h["stage"], got)
            if got != expected:
                raise ValueError(mismatch_message(h["stage"], h["mb"], got, expected))
            if "payload" not in h:
                h["payload"] = self._irecv(torch.empty(got[0], dtype=got[1], device=self.device), h["peer"],
                                           tag(0, h["stage"], h["mb"], self.num_stages, 1))
        work, buf = h["payload"]
        fault.wait(work, h["what"], self.group)
        return buf

    def send_gradient(self, g: Tensor, stage: int, microbatch: int, peer: int) -> None:
        self._isend(g, peer, tag(1, stage, microbatch, self.num_stages, 1))

    def finish(self) -> None:
        """Wait for every send of the step (their buffers may be reused after)."""
        for work, _ in self.pending:
            fault.wait(work, "pipeline send", self.group)
        self.pending.clear()
        self.contract.clear()
