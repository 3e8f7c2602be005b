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
pipeline rank.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

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
                             targets.shape[0] if targets is not None else -1], dtype=torch.int64)
        sizes = [torch.zeros_like(mine) for _ in range(self.ranks)]
        if self.ranks > 1:
            dist.all_gather(sizes, mine.to(self.device) if self.device.type == "cuda" else mine, group=self.group)
        else:
            sizes = [mine]
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
        saved: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (input, output or scaled loss)
        local: dict[tuple, Tensor] = {}  # activations and gradients handed over within this rank
        inbox: dict[tuple, Tensor] = {}
        total = torch.zeros((), dtype=torch.float64)
        sync = self.data_parallel.no_sync() if self.data_parallel is not None else contextlib.nullcontext()
        try:
            with sync:
                for a in self.actions[self.rank]:
                    k, i = a.stage, a.microbatch
                    if a.kind == RECV_F:
                        inbox[("act", k, i)] = msg.recv_activation(k, i, a.peer)
                    elif a.kind == RECV_B:
                        inbox[("grad", k, i)] = msg.recv_gradient(saved[(k - 1, i)][1], k, i, a.peer)
                    elif a.kind == FORWARD:
                        x = x_mb[i] if k == 0 else inbox.pop(("act", k - 1, i), None)
                        if x is None:
                            x = local.pop(("act", k - 1, i))
                        if k > 0 and x.is_floating_point():
                            x = x.detach().requires_grad_(True)
                        y = self.stages.chunk(k)(x)
                        if not isinstance(y, Tensor):
                            raise TypeError(f"pipeline stage {k} returned {type(y).__name__}; a stage must return one "
                                            "tensor (its activations), as must every layer of the layer list")
                        if k == self.num_stages - 1:
                            y = self.loss_fn(y, y_mb[i]) * scale
                            total += y.detach().double().cpu()
                        elif self.stages.ranks == 1 or (k + 1) % self.ranks == self.rank:
                            local[("act", k, i)] = y.detach()
                        saved[(k, i)] = (x, y)
                    elif a.kind == SEND_F:
                        msg.send_activation(saved[(k, i)][1], k, i, a.peer)
                    elif a.kind == BACKWARD:
                        x, y = saved.pop((k, i))
                        if k == self.num_stages - 1:
                            grad = None
                        else:
                            grad = inbox.pop(("grad", k + 1, i), None)
                            if grad is None:
                                grad = local.pop(("grad", k + 1, i))
                        if y.requires_grad:
                            torch.autograd.backward(y, grad)
                        if k > 0:
                            dx = x.grad if x.grad is not None else torch.zeros_like(x)
                            if (k - 1) % self.ranks == self.rank:
                                local[("grad", k, i)] = dx
                            else:
                                saved[("dx", k, i)] = (None, dx)
                    elif a.kind == SEND_B:
                        msg.send_gradient(saved.pop(("dx", k, i))[1], k, i, a.peer)
                self.stages.sync_tied_grads()
            if self.data_parallel is not None:
                self.data_parallel.reduce_gradients()
        finally:
            msg.finish()
        if self.ranks > 1:
            dist.broadcast(total, src=dist.get_global_rank(self.group, self.last_rank) if self.group is not None
                           else self.last_rank, group=self.group)
        return total.float()

    def clip_grad_norm_(self, max_norm: float, *, tp_group: dist.ProcessGroup | None = None) -> Tensor:
        """Clip by the global norm over this pipeline's stages, the TP group and (ZeRO) the
        data-parallel shards; a tied parameter counts once. Call after `step()`."""
        return clip_grad_norm_(self.stages, max_norm, data_parallel=self.data_parallel, tp_group=tp_group,
                               pp_group=self.group)
