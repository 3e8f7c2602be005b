"""What ZeRO does during forward and backward: stage 2's gradient hooks, stage 3's module
hooks (gather before forward and backward, free after), the prefetch order, and which groups
are reduced when (`ZeROHooks`).

Note [agreed reduction order]: NCCL matches collectives by issue order, so every rank must
issue the same reduce-scatters in the same order whatever its gradients do. Every group is
reduce-scattered once per reduction, in one fixed order: the wrapped groups in reverse
registration order (a guess at the backward order), then the root. Stage 1 (and any
reduction after `no_sync()`) reduces all of them at the first of `step()` /
`clip_grad_norm_()` / `reduce_gradients()` after the backward; whether to is decided by the
calls every rank makes alike (the stage, `no_sync()`, `step()`), never by this rank's own
gradients. At stages 2/3 a group is reduced once its
backward is done and every group before it in the order was reduced; the end of backward
reduces the rest, in order. A group whose backward ends out of that order keeps its full
gradients until the groups before it are reduced: correct, with more memory; registering
the wrapped modules in forward order avoids it. Stage 3 cannot use its params' gradient
hooks to decide that a group is done, as stage 2 does: they are local (a param unused on one
rank never fires), and stage 3 interleaves its backward all-gathers with the reduce-scatters,
so a reduce-scatter issued early on one rank and late on another would cross an all-gather.
It uses the module's backward instead (an identity autograd node on the module's inputs,
`_AfterBackward`), an event every rank sees at the same point. Whether an input requires
grad can itself depend on the data, so when none does, the first floating input is marked
through a leaf that does (its gradient is then computed, the price of agreement); only a
module with no floating input at all (token ids) is reduced at the end of backward, on
every rank alike. Collectives of other code on the data-parallel group during backward (a
SyncBatchNorm on the same group, say) may still fall between these reductions differently
on each rank when parameters go unused: give them a group of their own.

Note [ZeRO unused parameters]: a parameter with no gradient on this rank (data-dependent
control flow; a sub-module skipped) contributes zeros to the average over all ranks; one that
no rank used since the last step keeps no shard gradient (Note [a parameter no rank used]). A whole
wrapped module skipped in forward on one rank only is not supported at stage 3: its
all-gathers would not match across ranks. With PARALLEL_LAYERS_DEBUG=1 that is an error on
every rank (the agreement check before each all-gather); without, a hang or a CollectiveError.

Note [overlapped reduce-scatter]: at stages 2/3 a group's reduce-scatter is launched
asynchronously as soon as the group is reduced in the agreed order and waited for (its slot
accumulated into the shard gradients) when the next group's is launched, or at the end of
backward: the collective runs while backward computes the layers before it, as FSDP2 overlaps
its reduce-scatters, and at most two are in flight. The launch order, the only thing the ranks
must agree on, is unchanged. Reductions outside backward (stage 1, after `no_sync()`) wait at once.

Note [last group stays gathered]: at stage 3 the group whose forward runs last (known from
the first step on) is not freed after its forward: backward starts with it, so freeing it
would only gather it again at once (torchtitan keeps the last block unsharded for the same
reason; FSDP2 does it for the root). Backward's end frees it with the others, and
`ZeRO.step()` frees every stage-3 group before the optimizer step, so a forward that no
backward followed cannot leave stale values gathered.

Note [expert groups]: one rank's experts under expert parallelism
(parallel_layers/expert_parallel.py) are in groups over their replica group (the data-parallel
ranks holding the same experts), not over dp, with no module hooks (they stay gathered at
stage 3). With the experts over all of dp the replica group is this rank alone: no collective,
so no order to agree on, and each group is reduced (a local copy into its shard) as soon as its
parameters' gradients are in (in the dp order it would hold back every group after it until the
end of backward). Over replicas of several ranks, they are reduced at the end of backward, every
one, in one order (reverse registration), after every dp group's reduce-scatter was launched,
two in flight at a time (by then no all-to-all is left to wait on) - not as their gradients
arrive: when they arrive depends on the routing (where no token reached this rank's experts,
transformers' eager kernel computes nothing from their weights, and their zero gradient comes
at another point of the backward: expert_parallel.py), and a rank blocked on a replica's reduce-scatter mid-backward while
its expert-parallel partners wait for it in the next all-to-all is a cycle across the groups
(a hang; NCCL also asks every rank to issue its communicators' collectives in one order). The
cost: the experts' full gradients live until the end of backward (as at ZeRO-1) and their
reduction is not overlapped with backward. At stage 1 and after `no_sync()` they are reduced
with the others, in registration order.

Note [backward without parameters]: an embedding's backward reads no parameter (the gradient
of a lookup is a scatter-add of the output's gradient into rows: the ids and the table's size
are all it needs), so a unit that is a plain lookup - an nn.Embedding or a
VocabParallelEmbedding running its own class's forward - is not gathered again for backward
(`ParamGroup.gather_for_backward`, set by ZeRO, the same on every rank). Its gradient
accumulates into the full parameter's .grad while the parameter's storage stays freed (autograd
checks the gradient against the parameter's shape, which freeing keeps). That saves an all-gather
of vocab x hidden a step, what FSDP2 spends on a fully_shard-ed embedding. A subclass with its
own forward (Gemma's scaled rows) may read its weight in ways its backward needs: gathered.

Note [ZeRO prefetch]: the order of the groups' forwards is recorded in the first forward.
Afterwards, while group i computes, the all-gather of the group after it runs (forward) or
of the group before it (backward, which runs in reverse): one collective waited on, one in
flight.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree

from parallel_layers import fault
from parallel_layers.zero._group import ParamGroup
from parallel_layers.zero._param import python_tracer_on


@dataclasses.dataclass
class _BackwardState:
    """Where one group is in the current backward (Note [agreed reduction order])."""
    pending_grads: int = 0  # stage 2: params still to receive their gradient
    open_calls: int = 0  # stage 3: forward calls of the module whose backward has not run yet
    input_without_grad: bool = False  # stage 3: a call no backward event marks; wait for the end
    done: bool = False


class _AfterBackward(torch.autograd.Function):
    """Identity forward on a module's inputs; backward calls `callback` once the gradients of
    all of them are computed. The node is created before the module's own, so the autograd
    engine runs it after all of them, and after their parameters' gradient accumulation
    (which it runs first, when ready)."""

    @staticmethod
    def forward(ctx, callback, anchors, *xs):
        # The first `anchors` of xs are leaves that only make the outputs require grad.
        ctx.callback, ctx.anchors = callback, anchors
        return xs[anchors:]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, None, *([None] * ctx.anchors), *grads)


class ZeROHooks:
    """The hooks of one ZeRO wrapper and the state they share across a step.

    `groups` in registration order, the root (if any) last; `module_group`: id(module) ->
    its group, for stage 3's module hooks; `syncing()`: False inside `no_sync()`.
    """

    def __init__(self, module: nn.Module, groups: list[ParamGroup], module_group: dict[int, ParamGroup],
                 root: ParamGroup | None, stage: int, *, prefetch: bool, reshard_after_forward: bool,
                 syncing: Callable[[], bool], experts: list[ParamGroup] = ()):
        self.groups, self.stage, self.syncing = groups, stage, syncing
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        # Note [expert groups]: reduced as soon as done (this rank alone), or at the end of backward
        self.experts = list(experts)
        self.alone = [g for g in self.experts if g.world == 1]
        self.replicated = [g for g in reversed(self.experts) if g.world > 1]
        # Note [agreed reduction order]
        self.order = [g for g in reversed(groups) if g is not root and g not in self.experts] + (
            [root] if root is not None else [])
        self.reduced = 0  # groups of self.order reduced in this backward
        # Full gradients may wait for a reduction at step() (Note [agreed reduction order]):
        # decided by what every rank's program does (stage, no_sync, step), not by p.grad.
        self.unreduced = stage == 1
        self.backward = {g: _BackwardState() for g in groups}
        self.forward_order: list[ParamGroup] = []  # groups as their forward ran, first step (Note [ZeRO prefetch])
        self.order_known = False  # forward_order is complete (a backward has ended since it was recorded)
        self.callback_queued = False
        self.reducing: ParamGroup | None = None  # Note [overlapped reduce-scatter]
        self.handles = []
        self.marking = True  # freed parameters are marked (Note [reading a freed parameter] in _param.py)
        if stage == 2:
            self._install_grad_hooks(self.order)
        # stage 2 reduces at the end of backward, which a parameter's hook queues: with no
        # trainable parameter at build (a model unfrozen after it), none does, and the step
        # reduces, as at stage 1 (review finding: it never trained)
        self.unhooked = stage == 2 and not self.handles
        self.unreduced = self.unreduced or self.unhooked
        if stage >= 2:
            self._install_grad_hooks(self.alone + self.replicated)  # the latter: to queue the end of backward
        if stage == 3:
            self._install_module_hooks(module, module_group)
            self.handles.append(module.register_forward_pre_hook(lambda *_: self.profiler_check()))

    # ---- reductions (Note [agreed reduction order]) --------------------------------------
    def defer_reduction(self) -> None:
        """Gradients now accumulate locally (`no_sync()`): reduce them at the next chance."""
        self.unreduced = True

    def reduce_remaining(self) -> None:
        """Full gradients not yet reduced (stage 1, or after no_sync) -> shard gradients, every
        group in the agreed order. Whether to reduce is decided by the calls every rank makes
        alike, never by this rank's gradients."""
        if self.unreduced:
            for g in self.order + self.experts:
                g.reduce_grads(free_full_grads=True)
            self.unreduced = False

    def after_step(self) -> None:
        self.unreduced = self.stage == 1 or self.unhooked
        self.forget_uses()

    def forget_uses(self) -> None:
        """A new step: no gradient reduced, no shard gradient made yet (Note [a parameter no rank used])."""
        for g in self.order + self.experts:
            for sp in g.members:
                sp.used = sp.grad_made = False

    # Note [a parameter no rank used]: the reduce-scatter gives a parameter that got no gradient
    # on any rank since the last step (a layer the data skipped everywhere, a step with no
    # backward at all) a zero shard gradient, which AdamW's weight decay and momentum then step:
    # the plain model keeps its .grad None and the optimizer skips it (review finding: 7.7e-2 off
    # after 5 AdamW steps at ZeRO-3; at stage 1 a step() with no backward moved every parameter).
    # So before the optimizer steps, one all-reduce per process group of the reducing groups
    # (the data-parallel group; the experts' replica groups) sums one flag per trainable
    # parameter - whether this rank reduced a gradient of it since the last step - and a shard
    # gradient the step's reductions made for a parameter no rank used is dropped. DataParallel
    # does the same inside its buckets (Note [unused parameters] in data_parallel.py); ZeRO's
    # flat reduce-scatter has no room for counts, so it costs one collective of a few hundred
    # numbers a step. The counts are read (a host sync on a GPU) only on a rank that left a
    # parameter unused: one it used has a count of at least 1. A shard gradient left from before
    # this step (no zero_grad between steps) stays, as a plain .grad does.
    def drop_gradients_no_rank_made(self) -> None:
        by_group: dict = {}  # process group -> its trainable members, in the agreed order
        for g in self.order + self.experts:
            if g.world > 1:
                by_group.setdefault(g.group, []).extend(sp for sp in g.members if sp.full.requires_grad)
        for group, members in by_group.items():
            if not members:
                continue
            mine = all(sp.used for sp in members)
            device = members[0].full.device  # the collectives' (an offloaded shard is on the CPU)
            flags = (torch.ones(len(members), device=device) if mine
                     else torch.tensor([float(sp.used) for sp in members]).to(device))
            with fault.collective("ZeRO used-parameter counts all_reduce", group):
                dist.all_reduce(flags, group=group)
            if mine:
                continue
            for sp, users in zip(members, flags.tolist()):
                if users == 0 and sp.grad_made:
                    sp.shard.grad = None
        for g in self.order + self.experts:  # this rank alone: its own uses decide
            if g.world == 1:
                for sp in g.members:
                    if sp.full.requires_grad and not sp.used and sp.grad_made:
                        sp.shard.grad = None

    def _backward_done(self, g: ParamGroup) -> None:
        """Reduce, in the agreed order, the groups whose backward is done (Note [expert groups]:
        a group of this rank alone at once, the replicated experts' at the end of backward)."""
        self.backward[g].done = True
        if g in self.alone:
            if self.syncing():
                g.reduce_grads(free_full_grads=True)
            return
        if g in self.replicated:
            return
        while self.syncing() and self.reduced < len(self.order) and self.backward[self.order[self.reduced]].done:
            self._launch_reduce(self.order[self.reduced])
            self.reduced += 1

    def _launch_reduce(self, g: ParamGroup) -> None:
        """Launch g's reduce-scatter, then finish the one before it (Note [overlapped reduce-scatter])."""
        g.reduce_grads(free_full_grads=True, async_op=True)
        if self.reducing is not None:
            self.reducing.finish_reduce()
        self.reducing = g

    def forget_failed_backward(self) -> None:
        """Before a forward: a backward that raised never reached `_finalize_backward`, whose
        callback autograd dropped, and the flag saying it was queued stayed set - no later
        backward reduced its groups at its end (review finding: 1.1 off the plain model after
        two steps at stages 2 and 3). Wait for the reduction it left in flight and start afresh
        (Note [a backward that raised] in data_parallel.py)."""
        if not self.callback_queued or torch._C._current_graph_task_id() != -1:  # none, or one running
            return
        self.callback_queued = False
        if self.reducing is not None:
            self.reducing.finish_reduce()
            self.reducing = None
        for g in self.replicated:
            g.finish_reduce()
        self.reduced = 0
        self.backward = {g: _BackwardState() for g in self.groups}
        for g in self.groups:
            if not g.keep_full:
                g.reshard()

    def _queue_finalize(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self) -> None:
        """End of backward: the groups not reduced yet are reduced now, in the agreed order."""
        self.callback_queued = False
        self.order_known = bool(self.forward_order)
        if self.syncing():
            for g in self.order[self.reduced:]:
                self._launch_reduce(g)
            for g in self.alone:
                if not self.backward[g].done:  # parameters that got no gradient in this backward
                    g.reduce_grads(free_full_grads=True)
            previous = None  # the experts over replicas, two in flight (Note [expert groups])
            for g in self.replicated:
                g.reduce_grads(free_full_grads=True, async_op=True)
                if previous is not None:
                    previous.finish_reduce()
                previous = g
            self.unreduced = False
        if self.reducing is not None:
            self.reducing.finish_reduce()
            self.reducing = None
        for g in self.replicated:
            g.finish_reduce()  # the last one launched (the others are done: a no-op)
        self.reduced = 0
        self.backward = {g: _BackwardState() for g in self.groups}
        for g in self.groups:
            if not g.keep_full:
                g.reshard()
        for pool in {id(g.pool): g.pool for g in self.groups if g.pool is not None}.values():
            pool.trim()  # Note [CPU buffer reuse] in _group.py
        self.profiler_check()  # marks back as soon as the tracer is off (Note [reading a freed parameter])

    # ---- stage 2: a group is done when all its params' gradients arrived -----------------
    def _install_grad_hooks(self, groups: list[ParamGroup]) -> None:
        for g in groups:
            for p in g.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(g)))

    def _make_grad_hook(self, g: ParamGroup):
        def hook(_param):
            self._queue_finalize()
            state = self.backward[g]
            if state.pending_grads == 0:  # first gradient of this group in this backward
                state.pending_grads = sum(p.requires_grad for p in g.params)
            state.pending_grads -= 1
            if state.pending_grads == 0:
                self._backward_done(g)
        return hook

    # ---- stage 3: gather around each module's forward and backward -----------------------
    def _install_module_hooks(self, module: nn.Module, module_group: dict[int, ParamGroup]) -> None:
        for m in module.modules():
            g = module_group.get(id(m))
            if g is None:
                continue
            self.handles.append(m.register_forward_pre_hook(
                lambda m, args, kwargs, g=g: self._pre_forward(g, args, kwargs), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._make_post_forward(g)))

    def profiler_check(self) -> None:
        """Freed parameters unmarked while torch.profiler's Python tracer runs (Note [reading a
        freed parameter] in _param.py)."""
        marking = not python_tracer_on()
        if self.stage == 3 and marking != self.marking:
            self.marking = marking
            for g in self.groups:
                for sp in g.members:
                    sp.set_marking(marking)

    def _neighbour(self, g: ParamGroup, step: int) -> ParamGroup | None:
        """The group `step` places after g in forward order, to prefetch (Note [ZeRO prefetch]);
        in backward (step -1), skipping the groups whose backward reads no parameter."""
        if not self.prefetch or g not in self.forward_order:
            return None
        i = self.forward_order.index(g) + step
        while step < 0 and i >= 0 and not self.forward_order[i].gather_for_backward:
            i -= 1
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None

    def _pre_forward(self, g: ParamGroup, args, kwargs):
        if g not in self.forward_order:
            self.forward_order.append(g)
        g.unshard()
        nxt = self._neighbour(g, +1)
        if nxt is not None:
            nxt.start_unshard()
        if not torch.is_grad_enabled():
            return None
        # The module's backward is done when its inputs' gradients are (Note [agreed reduction order]).
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        anchor = []
        if not at:
            # Whether an input requires grad can depend on the data (a branch on one rank), so
            # a floating input that does not is marked anyway, through a leaf that does: the
            # marker then fires at the same point of backward on every rank (at the cost of
            # that input's gradient). Only modules without floating inputs wait for the end.
            at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_floating_point()][:1]
            anchor = [torch.zeros((), device=flat[at[0]].device, requires_grad=True)] if at else []
        state = self.backward[g]
        if not at:
            state.input_without_grad = True
            return None
        state.open_calls += 1
        marked = _AfterBackward.apply(lambda: self._module_backward_done(g), len(anchor), *anchor,
                                      *(flat[i] for i in at))
        for i, t in zip(at, marked):
            flat[i] = t
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def _module_backward_done(self, g: ParamGroup) -> None:
        state = self.backward[g]
        state.open_calls -= 1
        if state.open_calls == 0 and not state.input_without_grad:
            g.reshard()
            self._backward_done(g)

    def _make_post_forward(self, g: ParamGroup):
        def post_forward(module, args, output):
            if not torch.is_grad_enabled():
                if self.reshard_after_forward:
                    g.reshard()
                return output
            tensors = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)
                       and t.requires_grad]
            if tensors:
                # Before this module's backward runs, its parameters must be back.
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(g), mode="any")
            if self.reshard_after_forward and not (self.order_known and g is self.forward_order[-1]):
                g.reshard()  # Note [last group stays gathered]
            return output
        return post_forward

    def _pre_backward(self, g: ParamGroup) -> None:
        self._queue_finalize()
        if g.gather_for_backward:  # Note [backward without parameters]
            g.unshard()
        prev = self._neighbour(g, -1)
        if prev is not None:
            prev.start_unshard()
