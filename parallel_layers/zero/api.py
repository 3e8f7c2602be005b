"""`ZeRO(model, optimizer_factory, stage=...)`: ZeRO-style sharded data parallelism.

    zero = ZeRO(model, lambda params: torch.optim.AdamW(params, lr=1e-3), stage=3)
    loss = loss_fn(zero(batch)); loss.backward(); zero.step(); zero.zero_grad()

Stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (ZeRO
paper). The optimizer only ever sees this rank's float32 shards (see _param.py, Note [ZeRO
sharded parameter]), so any torch.optim optimizer works and its state is sharded in every stage.

  stage 1  full params and full grads on every rank; at step(): reduce-scatter the grads
           into the shards, step the shards, all-gather the params.
  stage 2  as 1, but each group's grads are reduce-scattered and freed as soon as its
           backward is done (all its params' post-accumulate-grad hooks ran) and the groups
           before it in the agreed order were reduced, so full grads do not pile up.
  stage 3  as 2, and each wrapped module's params are all-gathered right before its forward
           and its backward and freed after (reshard_after_forward; the root is kept). A
           group's backward is done when its module's backward is (the gradient of the
           module's inputs is computed), not when its params' gradients arrived.

offload_optimizer=True (ZeRO-Offload) keeps the shards, their gradients and the optimizer
state and step on the CPU while the parameters and activations stay on the GPU; reduced
gradients go down and updated shards come up once per step.

Groups: one per module for which `wrap(module)` is true (default: every direct child of
the model with parameters), plus a root group for the remaining parameters. Gradients are
averaged over the data-parallel group. `no_sync()` accumulates gradients locally (full
grads kept) until the next backward outside it.

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
control flow; a sub-module skipped) contributes zeros to the average over all ranks. A whole
wrapped module skipped in forward on one rank only is not supported at stage 3: its
all-gathers would not match across ranks. With PARALLEL_LAYERS_DEBUG=1 that is an error on
every rank (the agreement check before each all-gather); without, a hang or a CollectiveError.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree

from parallel_layers import fault, placement
from parallel_layers._accumulation import LocalAccumulation
from parallel_layers.grad_norm import clip_grad_norm_
from parallel_layers.zero._group import ParamGroup
from parallel_layers.zero._param import ShardedParam, check_dtypes


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


def _default_wrap(model: nn.Module):
    children = {id(m) for m in model.children() if any(True for _ in m.parameters())}
    return lambda m: id(m) in children


class ZeRO(LocalAccumulation, nn.Module):
    def __init__(self, model: nn.Module, optimizer_factory: Callable, stage: int = 3, *,
                 group: dist.ProcessGroup | None = None, wrap: Callable[[nn.Module], bool] | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 reshard_after_forward: bool = True, prefetch: bool = True, offload_optimizer: bool = False):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be a callable that builds the optimizer from the shards it is "
                            f"given (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), got "
                            f"{type(optimizer_factory).__name__}: ZeRO's optimizer steps this rank's shards, not the "
                            "model's parameters")
        check_dtypes(param_dtype, reduce_dtype)
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed to be initialised (init_parallel or init_process_group)")
        self.module, self.stage, self.group = model, stage, group
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._forward_order: list[ParamGroup] = []  # groups as their forward ran, first step

        def param_group(name: str, params: list[nn.Parameter], root: bool) -> ParamGroup:
            # ZeRO-3 frees the wrapped modules' full parameters between uses; the root's and
            # ZeRO-1/2's stay, and at ZeRO-1/2 a master shard may be a view of them.
            return ParamGroup(name, [ShardedParam(p, group, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                  keep_full=stage < 3 or root, alias_full=stage < 3,
                                                  offload=offload_optimizer) for p in params])

        wrap = wrap or _default_wrap(model)
        owned: set[int] = set()
        self.groups: list[ParamGroup] = []
        self._module_group: dict[int, ParamGroup] = {}
        for name, module in model.named_modules():
            if module is model or not wrap(module):
                continue
            params = [p for p in module.parameters() if id(p) not in owned]
            if params:
                owned.update(id(p) for p in params)
                g = param_group(name, params, root=False)
                self.groups.append(g)
                self._module_group[id(module)] = g
        rest = [p for p in model.parameters() if id(p) not in owned]
        self.root_group = param_group("<root>", rest, root=True) if rest else None
        if self.root_group is not None:
            self.groups.append(self.root_group)
        # Note [agreed reduction order]
        self._order = [g for g in reversed(self.groups) if g is not self.root_group] + \
            ([self.root_group] if self.root_group is not None else [])
        self._reduced = 0  # groups of self._order reduced in this backward
        # Full gradients may wait for a reduction at step() (Note [agreed reduction order]):
        # decided by what every rank's program does (stage, no_sync, step), not by p.grad.
        self._unreduced = stage == 1
        self._backward = {g: _BackwardState() for g in self.groups}
        self.optimizer = optimizer_factory([s for g in self.groups for s in g.shards])
        self._hook_handles = []
        if stage == 2:
            self._install_grad_hooks()
        if stage == 3:
            self._install_module_hooks()
        self._callback_queued = False

    # ---- hooks ----------------------------------------------------------------------------
    def _install_grad_hooks(self) -> None:
        for g in self.groups:
            for p in g.params:
                if p.requires_grad:
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(g)))

    def _make_grad_hook(self, g: ParamGroup):
        def hook(_param):
            self._queue_finalize()
            state = self._backward[g]
            if state.pending_grads == 0:  # first gradient of this group in this backward
                state.pending_grads = sum(p.requires_grad for p in g.params)
            state.pending_grads -= 1
            if state.pending_grads == 0:
                self._backward_done(g)
        return hook

    def _backward_done(self, g: ParamGroup) -> None:
        """Reduce, in the agreed order, the groups whose backward is done (Note [agreed reduction order])."""
        self._backward[g].done = True
        while self._sync and self._reduced < len(self._order) and self._backward[self._order[self._reduced]].done:
            self._order[self._reduced].reduce_grads(free_full_grads=True)
            self._reduced += 1

    def _install_module_hooks(self) -> None:
        for name, module in self.module.named_modules():
            g = self._module_group.get(id(module))
            if g is None:
                continue
            self._hook_handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, g=g: self._pre_forward(g, args, kwargs), with_kwargs=True))
            self._hook_handles.append(module.register_forward_hook(self._make_post_forward(g)))

    # Note [ZeRO prefetch]: the order of the groups' forwards is recorded in the first
    # forward. Afterwards, while group i computes, the all-gather of the group after it runs
    # (forward) or of the group before it (backward, which runs in reverse): one collective
    # waited on, one in flight.
    def _neighbour(self, g: ParamGroup, step: int) -> ParamGroup | None:
        if not self.prefetch or g not in self._forward_order:
            return None
        i = self._forward_order.index(g) + step
        return self._forward_order[i] if 0 <= i < len(self._forward_order) else None

    def _pre_forward(self, g: ParamGroup, args, kwargs):
        if g not in self._forward_order:
            self._forward_order.append(g)
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
        state = self._backward[g]
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
        state = self._backward[g]
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
            if self.reshard_after_forward:
                g.reshard()
            return output
        return post_forward

    def _pre_backward(self, g: ParamGroup) -> None:
        self._queue_finalize()
        g.unshard()
        prev = self._neighbour(g, -1)
        if prev is not None:
            prev.start_unshard()

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self) -> None:
        """End of backward: the groups not reduced yet are reduced now, in the agreed order."""
        self._callback_queued = False
        if self._sync:
            for g in self._order[self._reduced:]:
                g.reduce_grads(free_full_grads=True)
            self._unreduced = False
        self._reduced = 0
        self._backward = {g: _BackwardState() for g in self.groups}
        for g in self.groups:
            if not g.keep_full:
                g.reshard()

    # ---- public API -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.stage == 3 and self.root_group is not None:
            self.root_group.unshard()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside it (or `reduce_gradients()`,
        `clip_grad_norm_()`, `step()`) reduces the accumulated sum."""
        self._unreduced = True
        with super().no_sync():
            yield

    def _reduce_remaining(self) -> None:
        """Full gradients not yet reduced (stage 1, or after no_sync) -> shard gradients, every
        group in the agreed order (Note [agreed reduction order]). Whether to reduce is decided
        by the calls every rank makes alike, never by this rank's gradients."""
        if self._unreduced:
            for g in self._order:
                g.reduce_grads(free_full_grads=True)
            self._unreduced = False

    def reduce_gradients(self) -> None:
        """Reduce-scatter now the full gradients accumulated under `no_sync()` into the shards:
        for a caller that runs several backwards per step (PipelineParallel)."""
        self._reduce_remaining()

    def clip_grad_norm_(self, max_norm: float, *, tp_group: dist.ProcessGroup | None = None,
                        pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Clip the (sharded) gradients by the global L2 norm of the whole model (over the
        data-parallel group, and the tensor- and pipeline-parallel groups when given); returns
        the norm before clipping."""
        self._reduce_remaining()
        return clip_grad_norm_(self.module, max_norm, data_parallel=self, tp_group=tp_group, pp_group=pp_group)

    def step(self) -> None:
        self._reduce_remaining()
        for g in self.groups:
            g.drop_prefetch()
        self.optimizer.step()
        for g in self.groups:
            if g.keep_full:
                g.refresh_full()  # the others gather at their next use
        self._unreduced = self.stage == 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for g in self.groups:
            for p in g.params:
                p.grad = None

    # ---- state ----------------------------------------------------------------------------
    def state_placement(self, prefix: str = "") -> placement.ModelPlacement:
        """What this rank holds of the model (parallel_layers.placement): each parameter as its
        float32 master shard, a flat element range of the (TP-local) parameter; buffers as
        the module has them. Writing into the shards must be followed by `after_load`."""
        described = placement.describe(self.module, prefix)
        sharded = {id(sp.full): sp for g in self.groups for sp in g.members}
        for tp in described.tensors.values():
            sp = sharded.get(id(tp.local))
            if sp is None:
                continue
            start = sp.rank * sp.shard_numel
            tp.pieces = placement.flat_pieces(placement.local_layout(tp.local), tuple(tp.local.shape), start,
                                              start + sp.shard_numel)
            tp.local = sp.shard
        described.shard_group = self.group if self.group is not None else dist.group.WORLD
        described.after_load.append(self._shards_replaced)
        return described

    def _shards_replaced(self) -> None:
        """The master shards were overwritten (a checkpoint load): the full parameters follow."""
        for g in self.groups:
            g.drop_prefetch()
            if g.keep_full:
                g.refresh_full()
            else:
                g.reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter gathered (a collective)."""
        for g in self.groups:
            g.refresh_full()
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for g in self.groups:
            if not g.keep_full:
                g.reshard()
        return state

    def sharded_state_dict(self) -> dict:
        """This rank's shards and optimizer state (no collective): save one per rank, load it
        back with `load_sharded_state_dict` at the same world size and wrap policy."""
        shards = {f"{g.name}/{i}": s.detach().clone() for g in self.groups for i, s in enumerate(g.shards)}
        return {"world_size": self.groups[0].world if self.groups else 1, "rank": self.groups[0].rank
                if self.groups else 0, "shards": shards, "optimizer": self.optimizer.state_dict()}

    def _sharded_state_problem(self, state) -> str | None:
        """Why `state` cannot be loaded on this rank, or None."""
        keys = ("world_size", "rank", "shards", "optimizer")
        if not isinstance(state, dict) or any(k not in state for k in keys):
            found = list(state)[:10] if isinstance(state, dict) else type(state).__name__
            return (f"load_sharded_state_dict expects the dict sharded_state_dict() returns, with keys {list(keys)}; "
                    f"got {found}")
        world = self.groups[0].world if self.groups else 1
        if state["world_size"] != world:
            return (f"sharded state dict was saved at world size {state['world_size']}, this ZeRO runs at {world}; "
                    "load the full state dict instead to change the world size")
        for g in self.groups:
            for i, s in enumerate(g.shards):
                key = f"{g.name}/{i}"
                if key not in state["shards"] or state["shards"][key].shape != s.shape:
                    return (f"sharded state dict has no shard {key!r} of shape {tuple(s.shape)}; was it saved with "
                            "another model or wrap policy?")
        return None

    def load_sharded_state_dict(self, state: dict) -> None:
        # Each rank reads its own file, so a bad one may be on one rank only: agree first, so
        # that every rank raises instead of the others waiting in the all-gather below.
        problem = self._sharded_state_problem(state)
        problems = [problem]
        if self.groups and self.groups[0].world > 1:
            problems = [None] * self.groups[0].world
            with fault.collective("ZeRO sharded state check all_gather_object", self.group):
                dist.all_gather_object(problems, problem, group=self.group)
        failed = [(r, p) for r, p in enumerate(problems) if p is not None]
        if failed:
            raise ValueError(problem if problem is not None else
                             "load_sharded_state_dict failed on rank(s) " + "; ".join(f"{r}: {p}" for r, p in failed))
        for g in self.groups:
            for i, s in enumerate(g.shards):
                with torch.no_grad():
                    s.copy_(state["shards"][f"{g.name}/{i}"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._shards_replaced()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: full params, full grads, master shards (not counting those
        that are views of full params), shard grads, optimizer state."""
        members = [sp for g in self.groups for sp in g.members]
        full = sum(sp.full.untyped_storage().size() for sp in members)
        full_grads = sum(sp.full.grad.numel() * sp.full.grad.element_size() for sp in members
                         if sp.full.grad is not None)
        # A master shard that is a view of its full parameter (ZeRO-1/2) costs nothing extra.
        shards = sum(sp.shard.numel() * sp.shard.element_size() for sp in members
                     if sp.shard.untyped_storage().data_ptr() != sp.full.untyped_storage().data_ptr())
        shard_grads = sum(sp.shard.grad.numel() * sp.shard.grad.element_size() for sp in members
                          if sp.shard.grad is not None)
        opt = sum(t.numel() * t.element_size() for st in self.optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"params": full, "grads": full_grads, "master_shards": shards, "shard_grads": shard_grads,
                "optimizer_state": opt}


__all__ = ["ZeRO"]
