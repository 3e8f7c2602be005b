"""`PipelineParallel`: run one training step of a pipelined model by its schedule's action list.

    stages = PipelineStages(layers, group=ctx.pp_group, virtual=1)
    model = ZeRO(stages, make_optimizer, stage=1, group=ctx.dp_group)   # or DataParallel, or nothing
    pipe = PipelineParallel(stages, schedule="1f1b", microbatches=8, loss_fn=F.cross_entropy,
                            data_parallel=model)
    loss = pipe.step(inputs, targets)    # forward + backward of the whole batch, gradients reduced
    model.step(); model.zero_grad()

`inputs` are needed on the rank of the first stage, `targets` on the rank of the last; both
are split on dim 0 into `microbatches` equal parts (an evaluation's batch into fewer where
they do not divide it: Note [evaluating any batch]). A padded batch's `attention_mask=` goes
with the inputs, to the layers that take it (Note [side inputs] in stages.py). The loss is normalised once for the whole
batch: `loss_fn` returns a microbatch mean and is scaled by 1 / m, or, with
`token_count=fn`, returns a microbatch sum and is divided by the sum of `token_count(target)`
over all microbatches (e.g. the number of non-ignored tokens) and over the data-parallel
replicas (Note [token mean over data parallelism] in _accumulation.py), so microbatches and
replicas of unequal weight are averaged exactly. Gradient accumulation over microbatches
therefore matches one big batch, and so does the data-parallel wrapper's average over replicas.

Each step: the batch sizes are checked on every pipeline rank (one small all-gather), the
schedule's actions run (Note [schedule construction] in schedule.py; messages in batched
rounds per Note [p2p rounds] there; shapes per Note [stage boundary contract] in _p2p.py), tied-parameter gradients are summed (Note [tied parameters]
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

from parallel_layers import _same_batch, fault
from parallel_layers._replica_refusal import refuse_together
from parallel_layers.expert_parallel import used_in as expert_parallel_used_in
from parallel_layers._token_ids import TokenIdError, labels_problem, labels_range, reads_labels, token_ids_problem
from parallel_layers._accumulation import token_divisor
from parallel_layers.grad_norm import clip_grad_norm_
from parallel_layers.pipeline._p2p import _DTYPES, _HEADER, Messenger, signature
from parallel_layers.pipeline.schedule import (BATCH, FORWARD, RECV_B, RECV_F, SEND_F, build_schedule, check_arguments,
                                               forward_only, validate)
from parallel_layers.pipeline import stage_random
from parallel_layers.pipeline.stages import PipelineStages


# Note [evaluating any batch]: a training step splits its batch into `microbatches` equal
# parts, and refuses a batch they do not divide (unequal parts would weigh their microbatch
# means unequally, and every part of a step keeps one boundary shape, Note [stage boundary
# contract] in _p2p.py). An evaluation (a step under no_grad: Parallelized.evaluate) is often
# handed what is left at the end of a validation set, so it splits a batch of n into the
# largest count of equal parts that divides n and is at most `microbatches` (7 rows at
# microbatches=4: one part of 7; 6 rows: 3 parts of 2) and runs the forwards of the same
# schedule built for that count. Equal parts keep the loss what one batch gives: the mean of
# equal microbatches' means, or the token count's sum over all of them. Every rank derives the
# count from rank 0's batch size, which the batch check all-gathers, so no rank needs more.
def evaluation_microbatches(batch: int, microbatches: int) -> int:
    """The microbatch count of an evaluation of `batch` rows (Note [evaluating any batch])."""
    if batch < 1:  # nothing to split: as a training step splits it
        return microbatches
    return next(m for m in range(min(batch, microbatches), 0, -1) if batch % m == 0)


class PipelineParallel:
    def __init__(self, stages: PipelineStages, *, schedule: str = "1f1b", microbatches: int,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], token_count: Callable[[Tensor], int] | None = None,
                 data_parallel=None, device: torch.device | str | None = None, tp_group=None):
        """tp_group: the tensor-parallel group of this rank's stages, whose ranks must be given the
        same batch; the step checks it (Note [same batch check] in parallel_layers/_same_batch.py)."""
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
        self._expert_parallel: bool | None = None  # whether a stage's experts use all-to-alls; looked at once
        # what the last stage multiplies the loss it backpropagates by, not the loss it reports: a
        # float16 loss scale (Note [one loss scale for every rank] in parallel_layers/_loss_scale.py)
        self.grad_scale = 1.0
        self.group, self.rank, self.ranks = stages.group, stages.rank, stages.ranks
        self.num_stages = stages.num_stages
        if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed ProcessGroup (the tensor-parallel group of this "
                            f"rank's stages) or None, got {type(tp_group).__name__}")
        self.tp_group = tp_group
        self.device = torch.device(device) if device is not None else next(
            (p.device for p in stages.parameters()), torch.device("cpu"))
        self.actions = build_schedule(schedule, self.ranks, microbatches, stages.virtual)  # validated
        # under no_grad (evaluate): the forwards and their messages only, checked by the same rules
        self._forward_lists = {microbatches: forward_only(self.actions)}  # by microbatch count
        validate(self._forward_lists[microbatches], self.ranks, microbatches, stages.virtual, kinds=(FORWARD,))
        self.last_rank = (self.num_stages - 1) % self.ranks
        self.messenger = Messenger(self.group, self.device)
        if self.ranks > 1:  # Note [a random stream per pipeline stage]
            stage_random.seed(self.rank, self.device)

    def _forward_actions(self, microbatches: int) -> list[list]:
        """Every rank's forwards and their messages for `microbatches` (Note [evaluating any
        batch]), built once per count and checked as the training schedule is."""
        if microbatches not in self._forward_lists:
            lists = forward_only(build_schedule(self.schedule, self.ranks, microbatches, self.stages.virtual))
            validate(lists, self.ranks, microbatches, self.stages.virtual, kinds=(FORWARD,))
            self._forward_lists[microbatches] = lists
        return self._forward_lists[microbatches]

    # ---- one step -------------------------------------------------------------------------
    def _check_batch(self, inputs: Tensor | None, targets: Tensor | None, mask: Tensor | None,
                     positions: Tensor | None = None, tp_refused: ValueError | None = None,
                     unread: tuple[bool, bool] = (False, False)) -> tuple:
        """Every pipeline rank learns both batch sizes and the side inputs' shapes (attention mask,
        position ids), and raises the same error on a bad one; returns the inputs' signature (Note
        [stage boundary contract] in _p2p.py) and the side inputs' (all -1 for one not given).
        tp_refused: this rank's TP group was given different batches; every pipeline rank raises it.
        unread: this rank was given an attention mask / position ids, which only pipeline rank 0 reads."""
        # Something other than a tensor (a tokenizer's BatchEncoding, a dict with an attention
        # mask) is sent as size -2, so that every rank refuses it together.
        not_tensor = [x is not None and not isinstance(x, Tensor) for x in (inputs, targets, mask, positions)]
        mine = torch.tensor([-2 if not_tensor[0] else inputs.shape[0] if inputs is not None else -1,
                             -2 if not_tensor[1] else targets.shape[0] if targets is not None else -1,
                             -2 if not_tensor[2] else -2 if not_tensor[3] else 0] +
                            signature(inputs if not not_tensor[0] else None) +
                            signature(mask if not not_tensor[2] else None) +
                            signature(positions if not not_tensor[3] else None) + [int(u) for u in unread] +
                            [int(tp_refused is not None)],
                            dtype=torch.int64, device=self.device)
        # the inputs' smallest and largest id (0, -1: none to check), before the TP flag, which stays
        # last (Note [token ids in range] in parallel_layers/_token_ids.py); on the device, no host sync
        ids = inputs if isinstance(inputs, Tensor) and inputs.numel() and self.stages.input_vocab is not None \
            and inputs.dtype in (torch.int64, torch.int32) else None
        ids_range = torch.stack(torch.aminmax(ids)).to(self.device, torch.int64) if ids is not None else \
            torch.tensor([0, -1], dtype=torch.int64, device=self.device)
        # and the labels a causal-LM loss reads, on the last rank (Note [labels in range])
        reads = self.stages.input_vocab is not None and reads_labels(targets, self.loss_fn)
        labels = labels_range(targets).to(self.device) if reads else \
            torch.tensor([0, -1], dtype=torch.int64, device=self.device)
        mine = torch.cat([mine[:-1], ids_range, labels, mine[-1:]])
        sizes = [mine]
        if self.ranks > 1:
            sizes = [torch.zeros_like(mine) for _ in range(self.ranks)]
            with fault.collective("pipeline batch-size check (all_gather)", self.group):
                dist.all_gather(sizes, mine, group=self.group)
        sizes = [t.tolist() for t in sizes]
        if tp_refused is not None:
            raise tp_refused
        refusing = [r for r, row in enumerate(sizes) if row[-1]]
        if refusing:
            raise ValueError(f"the tensor-parallel group of pipeline rank(s) {refusing} was given different batches "
                             "(its ranks name them): every rank of a tensor-parallel group must be given the same "
                             "batch: shard the data by ctx.coordinate('dp'), not by the global rank")
        n_in, n_tgt, mask_flag = sizes[0][0], sizes[self.last_rank][1], sizes[0][2]
        m = self.microbatches
        if -2 in (n_in, n_tgt, mask_flag):
            what = "inputs" if n_in == -2 else "targets" if n_tgt == -2 else "attention_mask or position_ids"
            raise TypeError(f"pipeline step needs its {what} as one tensor; got another object (a tokenizer's output "
                            "or a dict? pass its input_ids as the inputs and its attention_mask as attention_mask=)")
        if n_in < 0 or n_tgt < 0:
            raise ValueError(f"pipeline step needs inputs on pipeline rank 0 (got {'none' if n_in < 0 else n_in}) and "
                             f"targets on pipeline rank {self.last_rank}, the last stage's (got "
                             f"{'none' if n_tgt < 0 else n_tgt})")
        if n_in != n_tgt:
            raise ValueError(f"the batch has {n_in} inputs and {n_tgt} targets (sizes on dim 0): a step's inputs and "
                             "targets must be as many")
        if n_in % m and torch.is_grad_enabled():  # an evaluation splits it otherwise (Note [evaluating any batch])
            raise ValueError(f"the batch of {n_in} must divide into microbatches={m}; {n_in} % {m} = {n_in % m}; "
                             f"valid batch sizes are multiples of {m}")
        sig = tuple(sizes[0][3:3 + _HEADER])
        problem = self.stages.input_problem(tuple(sig[2:2 + sig[0]]), _DTYPES[sig[1]]) \
            if self.stages.input_problem is not None and sig[1] >= 0 else None
        if problem:  # the first layer's own check, on every rank (pipeline/hf.py)
            raise ValueError(problem)
        low, high = sizes[0][-5], sizes[0][-4]
        problem = token_ids_problem(self.stages.input_vocab, low, high) if high >= low else None
        if problem:  # rank 0's ids against the first layer's table, on every rank
            raise TokenIdError(problem)
        low, high = sizes[self.last_rank][-3], sizes[self.last_rank][-2]
        problem = labels_problem(self.stages.input_vocab, low, high) if self.stages.input_vocab else None
        if problem:  # the last rank's labels, against the vocabulary (the input embedding's, as a causal LM's head)
            raise TokenIdError(problem)
        mask_sig = tuple(sizes[0][3 + _HEADER:3 + 2 * _HEADER])
        pos_sig = tuple(sizes[0][3 + 2 * _HEADER:3 + 3 * _HEADER])
        for k, (name, side_sig) in enumerate((("attention_mask", mask_sig), ("position_ids", pos_sig))):
            elsewhere = [r for r, row in enumerate(sizes) if row[3 + 3 * _HEADER + k]]
            if elsewhere and side_sig[0] < 0:  # given where nothing reads it, and not where it is read
                raise ValueError(f"{name}= was given on pipeline rank(s) {elsewhere} only, which do not read it: "
                                 "give it with the inputs, on pipeline rank 0 (giving it on every rank is fine)")
            if side_sig[0] >= 0:
                self._check_side_input(name, sig, side_sig)
        return sig, mask_sig, pos_sig

    def _check_side_input(self, name: str, sig: tuple, side_sig: tuple) -> None:
        """A side input's checks (the attention mask, the position ids), on every rank (Note [side
        inputs] in stages.py): a layer of the pipeline takes it; integers of the inputs' shape (the
        positions may be one row for all)."""
        shape, got = list(sig[2:2 + sig[0]]), list(side_sig[2:2 + side_sig[0]])
        dtype = _DTYPES[side_sig[1]] if side_sig[1] >= 0 else None
        if name not in self.stages.side_inputs:
            raise ValueError(f"{name}= was given, but no layer of this pipeline takes one (a layer declares "
                             f"pipeline_side_inputs = (..., {name!r}), as the Hugging Face layers of "
                             "pipeline_layers='auto' do); leave it out")
        integer = dtype is not None and not dtype.is_floating_point
        if name == "attention_mask":
            ok = got == shape and integer
            what = f"an integer or bool tensor of the inputs' shape {shape} (1: a token to attend to, 0: padding)"
        else:
            ok = (integer and dtype != torch.bool and len(got) == 2 and got[1:] == shape[1:2]
                  and got[0] in (1, shape[0]))
            what = f"an integer tensor of the inputs' shape {shape} (or [1, {shape[1] if len(shape) > 1 else '?'}])"
        if not ok:
            raise ValueError(f"{name} must be {what}; got shape {got} and dtype {dtype or 'unsupported'}")

    def _side_inputs(self, given: dict[str, Tensor | None], sigs: dict[str, tuple], batch: int,
                     m: int) -> list[dict]:
        """Each of the m microbatches' side inputs - the attention mask, the position ids - each
        sent from pipeline rank 0 to every pipeline rank (each stage's layers need them, Note
        [side inputs]); [1, seq] position ids are expanded to the batch first."""
        parts: list[dict] = [{} for _ in range(m)]
        for name, sig in sigs.items():
            if sig[0] < 0:
                continue
            shape = list(sig[2:2 + sig[0]])
            full = given[name].to(self.device, torch.int64) if self.rank == 0 else torch.empty(
                shape, dtype=torch.int64, device=self.device)
            if self.ranks > 1:
                with fault.collective(f"pipeline {name} broadcast", self.group):
                    dist.broadcast(full, group=self.group, group_src=0)
            for part, rows in zip(parts, full.expand(batch, -1).chunk(m)):
                part[name] = rows
        return parts

    def step(self, inputs: Tensor | None = None, targets: Tensor | None = None, *,
             attention_mask: Tensor | None = None, position_ids: Tensor | None = None) -> Tensor:
        """Forward and backward of one batch by the schedule; returns the batch loss (every
        pipeline rank). attention_mask: [batch, seq] (1 attend, 0 padding), given with the
        inputs on pipeline rank 0, for pipelines whose layers take it (Note [side inputs]).
        position_ids: [batch, seq] or [1, seq], given with the inputs on pipeline rank 0, for
        pipelines whose layers take them (else each stage's arange(seq))."""
        check = getattr(self.data_parallel, "profiler_check", None)  # ZeRO-3's stages are called directly
        if check is not None:
            check()
        role = (inputs if self.rank == 0 else None, targets if self.rank == self.last_rank else None,
                attention_mask if self.rank == 0 else None,
                position_ids if self.rank == 0 else None)  # what this rank's stages read
        try:
            try:  # Note [same batch check] in parallel_layers/_same_batch.py
                _same_batch.check(role, ("inputs", "targets", "attention_mask", "position_ids"), self.tp_group,
                                  "tensor-parallel")
                tp_refused = None
            except ValueError as e:
                tp_refused = e
            unread = (attention_mask is not None and self.rank != 0, position_ids is not None and self.rank != 0)
            sig, mask_sig, pos_sig = self._check_batch(*role, tp_refused=tp_refused, unread=unread)
            if self.ranks > 1:  # the readers' inputs and targets against what the other ranks were given
                _same_batch.check((inputs, targets, attention_mask, position_ids),
                                  ("inputs", "targets", "attention_mask", "position_ids"), self.group, "pipeline",
                                  readers=(0, self.last_rank, 0, 0))  # side inputs: rank 0's are read
            refused = None
        except (TypeError, ValueError) as e:  # the same on every rank of this pipeline
            refused = e
        # Note [evaluation on one replica]: under no_grad (Parallelized.evaluate) no gradient is
        # reduced and no optimizer steps, so nothing needs the other data-parallel replicas to
        # agree: a step then exchanges nothing over dp (except token_count's divisor, the batch's
        # count over the replicas), and one replica may evaluate while the others train - as
        # evaluate runs without a pipeline. Its flag all-reduces over dp met the training
        # replicas' gradient buckets (gloo aborted; review finding). With token_count (the
        # divisor), expert parallelism (the all-to-alls) or ZeRO-3 (the gathers) every replica
        # evaluates together: then they agree on the batches too.
        grads = torch.is_grad_enabled()
        if self._expert_parallel is None:
            self._expert_parallel = expert_parallel_used_in(self.stages)
        together = (grads or self.token_count is not None or self._expert_parallel
                    or getattr(self.data_parallel, "stage", 0) == 3)  # ZeRO-3's gathers (review finding, helper-82)
        self._agree_on_batches(refused, replicas=self._replicas() if together else 1)
        m = self.microbatches if grads else evaluation_microbatches(sig[2], self.microbatches)
        side = self._side_inputs({"attention_mask": attention_mask, "position_ids": position_ids},
                                 {"attention_mask": mask_sig, "position_ids": pos_sig}, sig[2], m)
        x_mb = list(inputs.chunk(m)) if self.rank == 0 else None
        y_mb = list(targets.chunk(m)) if self.rank == self.last_rank else None
        msg = self.messenger
        msg.begin(sig)
        scale = None
        if y_mb is not None:
            if self.token_count is None:
                scale = 1.0 / m
            else:  # the batch's count over the dp replicas' last stages (Note [token mean over data parallelism])
                try:
                    count = sum(int(self.token_count(t)) for t in y_mb)
                except Exception as e:  # the divisor is a collective: join it, raise at the end (Note [a failed stage])
                    msg.fail(f"pipeline rank {self.rank} raised {type(e).__name__} in token_count: {e}", e)
                    count = 0
                divisor = float(token_divisor(count, self._dp_group(), self.device))
                scale = 1.0 / divisor if divisor > 0 else 0.0
        # under no_grad (Parallelized.evaluate) no gradient comes: nothing to reduce
        dp = self.data_parallel if grads else None
        sync = dp.no_sync() if dp is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with sync:
            if grads:
                self.stages.scale_tied_grads_before_step()  # Note [tied gradients accumulate] in stages.py
            actions = self.actions if grads else self._forward_actions(m)
            run = _StepRun(self, msg, actions[self.rank], x_mb, y_mb, scale, side)
            total = run.run()
            if grads:
                self.stages.sync_tied_grads()
        self.last_step_times = {"schedule_s": time.perf_counter() - start, "waiting_s": run.waiting_s,
                                "compute_s": run.compute_s}
        if dp is not None:
            dp.reduce_gradients()
        # The loss (from the last stage) and every rank's broken-contract flag in one all-reduce:
        # a contract broken anywhere is raised everywhere (Note [stage boundary contract]).
        summary = torch.stack([total, torch.tensor(float(msg.error is not None), dtype=torch.float64,
                                                   device=self.device)])
        if self.ranks > 1:
            with fault.collective("pipeline loss and error all_reduce", self.group):
                dist.all_reduce(summary, group=self.group)
        failed = bool(summary[1] > 0)
        # Another data-parallel replica's pipeline may have failed on its own data: then every
        # replica raises, so that none takes the optimizer step the others skip.
        dp_group, replicas = self._dp_group(), self._replicas() if grads else 1  # Note [evaluation on one replica]
        anywhere = failed
        if replicas > 1:
            flag = torch.tensor([float(failed)], device=self.device)
            with fault.collective("pipeline error all_reduce over data parallelism", dp_group):
                dist.all_reduce(flag, group=dp_group)
            anywhere = bool(flag.item() > 0)
        msg.finish(succeeded=not anywhere)  # not on an exception: a failed peer would make it wait for the timeout
        if anywhere:  # Note [a failed stage] in _p2p.py
            self._raise_failure(failed, replicas, dp_group)
        return summary[0].float()

    def _dp_group(self):
        return getattr(self.data_parallel, "group", None) if self.data_parallel is not None else None

    def _replicas(self) -> int:
        return dist.get_world_size(self._dp_group()) if self.data_parallel is not None and dist.is_initialized() else 1

    def _agree_on_batches(self, refused: Exception | None, replicas: int) -> None:
        """Raise `refused` (this pipeline's batch check), or another data-parallel replica's, on
        every rank (Note [a refusal on every replica] in parallel_layers/_replica_refusal.py);
        replicas: 1 where no other replica needs to agree."""
        refuse_together(refused, self._dp_group() if replicas > 1 else None)

    def _raise_failure(self, failed: bool, replicas: int, dp_group) -> None:
        """Every rank raises a failed step's first error: the failing rank its own exception,
        its pipeline's other ranks and the other replicas' a RuntimeError (a broken contract:
        ValueError) with its message. `failed`: this replica's pipeline failed."""
        msg = self.messenger
        mine = (msg.error, msg.exception is not None) if msg.error is not None else None
        errors = [mine] * self.ranks
        if failed and self.ranks > 1:
            with fault.collective("pipeline error all_gather", self.group):
                dist.all_gather_object(errors, mine, group=self.group)
        first = next((e for e in errors if e is not None), None)
        replica = None
        if replicas > 1:
            firsts = [first] * replicas
            with fault.collective("pipeline error all_gather over data parallelism", dp_group):
                dist.all_gather_object(firsts, first, group=dp_group)
            replica = next(i for i, e in enumerate(firsts) if e is not None)
            first = first or firsts[replica]
        if msg.exception is not None:
            raise msg.exception
        error, raised = first
        kind = RuntimeError if raised else ValueError  # a broken contract is a ValueError everywhere
        if not failed:
            raise kind(f"data-parallel replica {replica}'s pipeline failed this step: {error}")
        raise kind(error)

    def clip_grad_norm_(self, max_norm: float, *, tp_group: dist.ProcessGroup | None = None) -> Tensor:
        """Clip by the global norm over this pipeline's stages, the TP group and (ZeRO) the
        data-parallel shards; a tied parameter counts once. Call after `step()`."""
        return clip_grad_norm_(self.stages, max_norm, data_parallel=self.data_parallel, tp_group=tp_group,
                               pp_group=self.group)


class _StepRun:
    """One step's walk through this rank's actions, and what it holds meanwhile."""

    def __init__(self, pipe: PipelineParallel, msg: Messenger, actions: list, x_mb, y_mb, scale, side: list[dict]):
        self.pipe, self.msg, self.x_mb, self.y_mb, self.scale, self.side = pipe, msg, x_mb, y_mb, scale, side
        self.actions = actions  # this rank's, from the full schedule or its forwards alone (evaluate)
        self.saved: dict[tuple, tuple] = {}  # (stage, mb) -> (input, output or scaled loss)
        self.handed: dict[tuple, Tensor] = {}  # passed between stages of this rank (p = 1): ("act"|"grad", stage, mb)
        self.broken: set[tuple] = set()  # (stage, mb) whose output broke the boundary contract (zeros were sent)
        self.total = torch.zeros((), dtype=torch.float64, device=pipe.device)
        self.waiting_s = self.compute_s = 0.0  # blocked on a receive (the bubble, and latency); in F and B

    def run(self) -> Tensor:
        for a in self.actions:
            if a.kind == BATCH:
                self._exchange(a.ops)
                continue
            start = time.perf_counter()
            waited = (self._forward if a.kind == FORWARD else self._backward)(a.stage, a.microbatch)
            self.waiting_s += waited
            self.compute_s += time.perf_counter() - start - waited
        return self.total

    def _exchange(self, ops) -> None:
        """One schedule batch: sends of outputs and input gradients, receives of what is next."""
        sends, recvs = [], []
        for a in ops:
            if a.kind == SEND_F:  # y None: the stage failed (Note [a failed stage] in _p2p.py)
                y, broken = self.msg.outgoing(a.stage, a.microbatch, self.saved[(a.stage, a.microbatch)][1])
                if broken:
                    self.broken.add((a.stage, a.microbatch))
                sends.append((("act", a.stage, a.microbatch), y, a.peer))
            elif a.kind == RECV_F:
                recvs.append((("act", a.stage, a.microbatch), a.peer, None))
            elif a.kind == RECV_B:  # the gradient of what we sent for stage a.stage - 1: its shape
                if self.msg.is_dropped(("grad", a.stage, a.microbatch)):
                    continue
                out = self.saved[(a.stage - 1, a.microbatch)][1]
                like = (self.msg.contract[a.stage - 1] if (a.stage - 1, a.microbatch) in self.broken
                        else (tuple(out.shape), out.dtype))
                recvs.append((("grad", a.stage, a.microbatch), a.peer, like))
            else:
                dx = self.saved.pop(("dx", a.stage, a.microbatch))[1]
                if dx is not None:  # None: over a dropped boundary, no input was received
                    sends.append((("grad", a.stage, a.microbatch), dx, a.peer))
        self.msg.exchange(sends, recvs)  # issues, and waits only for a new boundary's header

    def _take(self, item: tuple) -> tuple[Tensor | None, float]:
        """An input of this rank's next compute, and how long waiting for it took; None if it
        does not come this step (Note [a failed stage] in _p2p.py)."""
        if item in self.handed:
            return self.handed.pop(item), 0.0
        if self.msg.is_dropped(item):
            return None, 0.0
        start = time.perf_counter()
        t = self.msg.wait(item)
        return t, time.perf_counter() - start

    def _forward(self, k: int, i: int) -> float:
        pipe = self.pipe
        x, waited = (self.x_mb[i], 0.0) if k == 0 else self._take(("act", k - 1, i))
        if x is not None and k > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = None  # the stage's output (the last stage's: its scaled loss); None if it failed or had no input
        if x is not None:
            try:
                with stage_random.active(pipe.device):  # Note [a random stream per pipeline stage]
                    y = pipe.stages.chunk(k)(x, **self.side[i])
                    if not isinstance(y, Tensor):
                        raise TypeError(f"pipeline stage {k} returned {type(y).__name__}; a stage must return one "
                                        "tensor (its activations), as must every layer of the layer list")
                    if k == pipe.num_stages - 1:
                        y = pipe.loss_fn(y, self.y_mb[i]) * self.scale
                if k == pipe.num_stages - 1:
                    self.total += y.detach().double()
                    if pipe.grad_scale != 1.0 and torch.is_grad_enabled():
                        y = y * pipe.grad_scale
            except Exception as e:  # raised on every rank at the step's end (Note [a failed stage] in _p2p.py)
                self._failed(e, f"the forward of stage {k}, microbatch {i}")
                y = None
        if k < pipe.num_stages - 1 and (k + 1) % pipe.ranks == pipe.rank:  # the next stage is ours too (p = 1)
            self.handed[("act", k, i)] = y.detach() if y is not None else None
        self.saved[(k, i)] = (x, y)
        return waited

    def _backward(self, k: int, i: int) -> float:
        pipe = self.pipe
        x, y = self.saved.pop((k, i))
        grad, waited = (None, 0.0) if k == pipe.num_stages - 1 else self._take(("grad", k + 1, i))
        # A broken contract or a failure (zeros went out instead of y) is raised at the step's
        # end; until then the step runs on, so that every message still meets its peer's.
        arrived = grad is not None or k == pipe.num_stages - 1  # not over a dropped boundary
        if y is not None and y.requires_grad and (k, i) not in self.broken and arrived:
            try:
                torch.autograd.backward(y, grad)
            except Exception as e:
                self._failed(e, f"the backward of stage {k}, microbatch {i}")
        if k > 0:
            dx = None if x is None else x.grad if x.grad is not None else torch.zeros_like(x)
            if (k - 1) % pipe.ranks == pipe.rank:
                self.handed[("grad", k, i)] = dx
            else:
                self.saved[("dx", k, i)] = (None, dx)
        return waited

    def _failed(self, e: Exception, where: str) -> None:
        self.msg.fail(f"pipeline rank {self.pipe.rank} raised {type(e).__name__} in {where}: {e}", e)
