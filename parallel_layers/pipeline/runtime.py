"""`PipelineParallel`: run one training step of a pipelined model by its schedule's action list.

    stages = PipelineStages(layers, group=ctx.pp_group, virtual=1)
    model = ZeRO(stages, make_optimizer, stage=1, group=ctx.dp_group)   # or DataParallel, or nothing
    pipe = PipelineParallel(stages, schedule="1f1b", microbatches=8, loss_fn=F.cross_entropy,
                            data_parallel=model)
    loss = pipe.step(inputs, targets)    # forward + backward of the whole batch, gradients reduced
    model.step(); model.zero_grad()

`inputs` are needed on the rank of the first stage, `targets` on the rank of the last; both
are split on dim 0 into `microbatches` equal parts. The loss is normalised once for the whole
batch: `loss_fn` returns a microbatch mean and is scaled by 1 / m, or, with
`token_count=fn`, returns a microbatch sum and is divided by the sum of `token_count(target)`
over all microbatches (e.g. the number of non-ignored tokens), so microbatches of unequal
weight are averaged exactly. Gradient accumulation over microbatches therefore matches one
big batch, and the data-parallel wrapper averages over replicas on top.

Each step: the batch sizes are checked on every pipeline rank (one small all-gather), the
schedule's actions run (Note [schedule construction] in schedule.py; shapes per Note [stage
boundary contract] in _p2p.py), tied-parameter gradients are summed (Note [tied parameters]
in stages.py), and the data-parallel wrapper reduces the gradients once, after the last
microbatch (its `no_sync()` holds them until then). The step's loss comes back on every
pipeline rank; `last_step_times` says how long the schedule ran, and of that how long this
rank computed (F and B) and waited on receives (the pipeline bubble, plus message latency).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault
from parallel_layers.grad_norm import clip_grad_norm_
from parallel_layers.pipeline._p2p import Messenger
from parallel_layers.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    build_schedule,
    check_arguments,
    validate,
)
from parallel_layers.pipeline.stages import PipelineStages


class PipelineParallel:
    def __init__(self, stages: PipelineStages, *, schedule: str = "1f1b", microbatches: int,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], token_count: Callable[[Tensor], int] | None = None,
                 data_parallel=None, device: torch.device | str | None = None):
        if not isinstance(stages, PipelineStages):
            raise TypeError(f"stages must be a PipelineStages (this rank's chunks of the model), got {type(stages)}")
        if schedule == "interleaved" and stages.virtual == 1 and stages.ranks > 1:
            raise ValueError("schedule 'interleaved' needs PipelineStages(..., virtual=v) with v >= 2 chunks per rank")
        check_arguments(schedule, stages.ranks, microbatches, stages.virtual)
        if data_parallel is not None and not (hasattr(data_parallel, "no_sync") and
                                              hasattr(data_parallel, "reduce_gradients")):
            raise TypeError(f"data_parallel must be a DataParallel or ZeRO wrapper (with no_sync() and "
                            f"reduce_gradients()), got {type(data_parallel)}")
        if getattr(data_parallel, "stage", 1) > 1 and stages.ranks > 1:
            warnings.warn(
                f"ZeRO stage {data_parallel.stage} under pipeline parallelism: the full gradients of every "
                "microbatch are kept until the step's last backward (then reduce-scattered once), so stage 2 saves "
                "no gradient memory over stage 1" + (", and stage 3 all-gathers each chunk's parameters for every "
                "microbatch's forward and backward" if data_parallel.stage == 3 else "") +
                "; ZeRO stage 1 is the usual choice with a pipeline", stacklevel=2)
        self.stages, self.schedule, self.microbatches = stages, schedule, microbatches
        self.loss_fn, self.token_count, self.data_parallel = loss_fn, token_count, data_parallel
        self.group, self.rank, self.ranks = stages.group, stages.rank, stages.ranks
        self.num_stages = stages.num_stages
        self.device = torch.device(device) if device is not None else next(
            (p.device for p in stages.parameters()), torch.device("cpu"))
        self.actions = build_schedule(schedule, self.ranks, microbatches, stages.virtual)
        if dist.is_initialized() and self.ranks > 1 and dist.get_backend(self.group) != "gloo":
            validate(self.actions, self.ranks, microbatches, stages.virtual, in_order=True)
        self.last_rank = (self.num_stages - 1) % self.ranks

    # ---- one step -------------------------------------------------------------------------
    def _check_batch(self, inputs: Tensor | None, targets: Tensor | None) -> None:
        """Every pipeline rank learns both batch sizes and raises the same error on a bad one."""
        mine = torch.tensor([inputs.shape[0] if inputs is not None else -1,
                             targets.shape[0] if targets is not None else -1], dtype=torch.int64, device=self.device)
        sizes = [mine]
        if self.ranks > 1:
            sizes = [torch.zeros_like(mine) for _ in range(self.ranks)]
            with fault.collective("pipeline batch-size check (all_gather)", self.group):
                dist.all_gather(sizes, mine, group=self.group)
        n_in, n_tgt = int(sizes[0][0]), int(sizes[self.last_rank][1])
        m = self.microbatches
        if n_in < 0 or n_tgt < 0:
            raise ValueError(f"pipeline step needs inputs on pipeline rank 0 (got {'none' if n_in < 0 else n_in}) and "
                             f"targets on pipeline rank {self.last_rank}, the last stage's (got "
                             f"{'none' if n_tgt < 0 else n_tgt})")
        if n_in % m or n_in != n_tgt:
            raise ValueError(f"the batch ({n_in} inputs, {n_tgt} targets) must have equal sizes divisible by "
                             f"microbatches={m}; {n_in} % {m} = {n_in % m}; valid batch sizes are multiples of {m}")

    def step(self, inputs: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        """Forward and backward of one batch by the schedule; returns the batch loss (every pipeline rank)."""
        self._check_batch(inputs if self.rank == 0 else None, targets if self.rank == self.last_rank else None)
        m = self.microbatches
        x_mb = list(inputs.chunk(m)) if self.rank == 0 else None
        y_mb = list(targets.chunk(m)) if self.rank == self.last_rank else None
        scale = None
        if y_mb is not None:
            scale = 1.0 / (sum(int(self.token_count(t)) for t in y_mb) if self.token_count else m)
        msg = Messenger(self.group, self.num_stages, self.device)
        sync = self.data_parallel.no_sync() if self.data_parallel is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with sync:
            run = _StepRun(self, msg, x_mb, y_mb, scale)
            total = run.run()
            self.stages.sync_tied_grads()
        self.last_step_times = {"schedule_s": time.perf_counter() - start, "waiting_s": run.waiting_s,
                                "compute_s": run.compute_s}
        if self.data_parallel is not None:
            self.data_parallel.reduce_gradients()
        msg.finish()  # not on an error: a failed peer would make it wait for the timeout
        if self.ranks > 1:
            with fault.collective("pipeline loss broadcast", self.group):
                dist.broadcast(total, src=dist.get_global_rank(self.group, self.last_rank) if self.group is not None
                               else self.last_rank, group=self.group)
        return total.float()

    def clip_grad_norm_(self, max_norm: float, *, tp_group: dist.ProcessGroup | None = None) -> Tensor:
        """Clip by the global norm over this pipeline's stages, the TP group and (ZeRO) the
        data-parallel shards; a tied parameter counts once. Call after `step()`."""
        return clip_grad_norm_(self.stages, max_norm, data_parallel=self.data_parallel, tp_group=tp_group,
                               pp_group=self.group)


class _StepRun:
    """One step's walk through this rank's actions, and what it holds meanwhile."""

    def __init__(self, pipe: PipelineParallel, msg: Messenger, x_mb, y_mb, scale):
        self.pipe, self.msg, self.x_mb, self.y_mb, self.scale = pipe, msg, x_mb, y_mb, scale
        self.actions = pipe.actions[pipe.rank]
        self.saved: dict[tuple, tuple] = {}  # (stage, mb) -> (input, output or scaled loss)
        self.inbox: dict[tuple, Tensor] = {}  # received or handed over within this rank: ("act"|"grad", stage, mb)
        self.posted: dict[int, dict] = {}  # action index -> receive posted ahead of time
        self.total = torch.zeros((), dtype=torch.float64, device=pipe.device)
        self.waiting_s = self.compute_s = 0.0  # blocked on a receive (the bubble, and latency); in F and B

    def run(self) -> Tensor:
        for j, a in enumerate(self.actions):
            start = time.perf_counter()
            if a.kind in (RECV_F, RECV_B):
                h = self.posted.pop(j, None) or self._post(j)
                self.inbox[("act" if a.kind == RECV_F else "grad", a.stage, a.microbatch)] = self.msg.wait(h)
                self.waiting_s += time.perf_counter() - start
            elif a.kind == SEND_F:
                self.msg.send_activation(self.saved[(a.stage, a.microbatch)][1], a.stage, a.microbatch, a.peer)
            elif a.kind == SEND_B:
                self.msg.send_gradient(self.saved.pop(("dx", a.stage, a.microbatch))[1], a.stage, a.microbatch,
                                       a.peer)
            else:
                self._post_next_receives(j)
                (self._forward if a.kind == FORWARD else self._backward)(a.stage, a.microbatch)
                self.compute_s += time.perf_counter() - start
        return self.total

    # A receive is posted before the compute ahead of it, so its latency hides behind that compute.
    def _post(self, j: int) -> dict | None:
        a = self.actions[j]
        if a.kind == RECV_F:
            return self.msg.post_activation(a.stage, a.microbatch, a.peer)
        out = self.saved.get((a.stage - 1, a.microbatch))  # the gradient has our output's shape
        return self.msg.post_gradient(out[1], a.stage, a.microbatch, a.peer) if out is not None else None

    def _post_next_receives(self, j: int) -> None:
        for q in range(j + 1, len(self.actions)):
            if self.actions[q].kind in (FORWARD, BACKWARD):
                break
            if self.actions[q].kind in (RECV_F, RECV_B) and q not in self.posted:
                h = self._post(q)
                if h is not None:
                    self.posted[q] = h

    def _forward(self, k: int, i: int) -> None:
        pipe = self.pipe
        x = self.x_mb[i] if k == 0 else self.inbox.pop(("act", k - 1, i))
        if k > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = pipe.stages.chunk(k)(x)
        if not isinstance(y, Tensor):
            raise TypeError(f"pipeline stage {k} returned {type(y).__name__}; a stage must return one tensor (its "
                            "activations), as must every layer of the layer list")
        if k == pipe.num_stages - 1:
            y = pipe.loss_fn(y, self.y_mb[i]) * self.scale
            self.total += y.detach().double()
        elif (k + 1) % pipe.ranks == pipe.rank:  # the next stage is ours too (p = 1)
            self.inbox[("act", k, i)] = y.detach()
        self.saved[(k, i)] = (x, y)

    def _backward(self, k: int, i: int) -> None:
        pipe = self.pipe
        x, y = self.saved.pop((k, i))
        grad = None if k == pipe.num_stages - 1 else self.inbox.pop(("grad", k + 1, i))
        if y.requires_grad:
            torch.autograd.backward(y, grad)
        if k > 0:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            if (k - 1) % pipe.ranks == pipe.rank:
                self.inbox[("grad", k, i)] = dx
            else:
                self.saved[("dx", k, i)] = (None, dx)
