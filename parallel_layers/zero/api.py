"""`ZeRO(model, optimizer_factory, stage=...)`: ZeRO-style sharded data parallelism.

    zero = ZeRO(model, lambda params: torch.optim.AdamW(params, lr=1e-3), stage=3)
    loss = loss_fn(zero(batch)); loss.backward(); zero.step(); zero.zero_grad()

Stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (ZeRO
paper). The optimizer steps only this rank's float32 shards (see _param.py, Note [ZeRO
sharded parameter]), so any optimizer whose update is elementwise works (AdamW, SGD, Adagrad, ...;
ones that need each parameter's shape - Adafactor, Muon, LBFGS - are refused: _optimizer.py) and
its state is sharded in every stage. A parameter no rank used in a step gets no shard gradient,
so the optimizer skips it as it skips a .grad of None (Note [a parameter no rank used] in _hooks.py).
The factory is called with the model's parameters, so groups by name or by shape work as on
the plain model; each is then replaced by its shard (Note [an optimizer over shards] in
parallel_layers/_optimizer.py).

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
grads kept) until the next backward outside it. When the groups are reduced, and what a
parameter unused on some ranks does: Note [agreed reduction order] and Note [ZeRO unused
parameters] in _hooks.py.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import _grad_bank, _optimizer, placement
from parallel_layers.data_parallel import release_frozen_hooks
from parallel_layers._accumulation import LocalAccumulation
from parallel_layers.grad_norm import clip_grad_norm_
from parallel_layers.zero import _state
from parallel_layers.zero._group import BufferPool, ParamGroup
from parallel_layers.zero._hooks import ZeROHooks
from parallel_layers.zero._param import ShardedParam, check_dtypes


def _default_wrap(model: nn.Module):
    """The model's children that hold parameters, looking through containers that have no
    forward (nn.ModuleList, nn.ModuleDict): a unit is gathered by its module's forward hooks,
    which a container never runs (a model's `layers` list would never be gathered). An
    nn.ParameterList / ParameterDict has no forward either: its parameters stay in the root."""
    units: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if not any(True for _ in child.parameters()) or isinstance(child, (nn.ParameterList, nn.ParameterDict)):
                continue  # nothing to gather, or parameters whose uses no forward of theirs marks: the root's
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(child)
            else:
                units.add(id(child))

    visit(model)
    return lambda m: id(m) in units


def _shared_parameters(model: nn.Module) -> set[int]:
    """Parameters registered by more than one module (a head tied to the embedding by sharing
    its weight, as Hugging Face models tie). Note [shared parameters]: at ZeRO-3 a wrapped
    module's group is freed after that module's forward, but a shared parameter is read by
    another module too (GPT-2's lm_head reads wte.weight after the transformer's forward), so
    shared parameters go to the root group, which stays gathered for the whole forward, as
    FSDP asks of parameters shared across its units. (A module held in two places, as our GPT's
    head holds the embedding module, is one registration: its group's hooks run at each use.)"""
    count: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            count[id(p)] = count.get(id(p), 0) + 1
    return {i for i, n in count.items() if n > 1}


def _plain_lookup(module: nn.Module) -> bool:
    """An embedding whose backward reads no parameter (Note [backward without parameters] in
    _hooks.py): nn.Embedding or VocabParallelEmbedding running its own class's forward, holding
    its weight alone, dense gradients."""
    from parallel_layers.tensor_parallel.vocab import VocabParallelEmbedding

    kind = next((c for c in (VocabParallelEmbedding, nn.Embedding) if isinstance(module, c)), None)
    return (kind is not None and type(module).forward is kind.forward and not getattr(module, "sparse", False)
            and [n for n, _ in module.named_parameters()] == ["weight"])


def _refuse_freed_parameters(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A plain state_dict() of a ZeRO-3 model between steps: its full parameters have no storage
    (`ShardedParam.free_full`), and what torch.save or transformers' save_pretrained wrote from
    them could not be loaded (review finding). The library's own readers (keep_vars=True: the
    placement, which reads the shards) and full_state_dict (after a gather) pass."""
    if keep_vars:
        return
    freed = [n for n, p in module.named_parameters() if p.numel() and not p.is_meta and p.untyped_storage().nbytes() == 0]
    if freed:
        raise RuntimeError(
            f"state_dict() of a model that ZeRO-3 shards: {len(freed)} of its full parameters (e.g. {freed[:3]}) have "
            "no storage between forward and backward, only this rank's shards do. Read the model through ZeRO: "
            "zero.full_state_dict() (every rank), parallel_layers.checkpoint.save(...), or "
            "parallel_layers.hf.save_pretrained(par.module, directory) instead of torch.save(model.state_dict()) or "
            "model.save_pretrained(...)")


def _pooled(groups: list[ParamGroup]) -> list[ParamGroup]:
    """The stage-3 groups that share the CPU buffer pool (Note [CPU buffer reuse] in _group.py):
    gathered and freed ones (not the root, not experts) whose parameter shapes at least three
    groups have: the repeated blocks, not the one-off units such as the vocabulary's."""
    def shapes(g: ParamGroup) -> tuple:
        return tuple((tuple(sp.full.shape), sp.full.dtype) for sp in g.members)

    freed = [g for g in groups if not g.keep_full]
    count: dict[tuple, int] = {}
    for g in freed:
        count[shapes(g)] = count.get(shapes(g), 0) + 1
    return [g for g in freed if count[shapes(g)] >= 3]


def _storage_shared_within(params: list[nn.Parameter]) -> set[int]:
    """Ids of the parameters whose storage is shared by several of `params` and by nothing
    else: their bytes add up to the whole storage (Note [storage shared within a group] in
    _param.py). Meta tensors have no storage to share."""
    by_storage: dict[int, list[nn.Parameter]] = {}
    for p in params:
        if not p.is_meta and p.untyped_storage().nbytes():  # a freed one's data_ptr raises
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    shared: set[int] = set()
    for users in by_storage.values():
        storage = users[0].untyped_storage()
        spans = sorted((p.storage_offset() * p.element_size(), p.numel() * p.element_size()) for p in users)
        tiles = all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])) and spans[0][0] == 0
        if (len(users) > 1 and storage.resizable() and tiles and all(p.is_contiguous() for p in users)
                and spans[-1][0] + spans[-1][1] == storage.nbytes()):
            shared.update(id(p) for p in users)
    return shared


def refuse_non_floating(model: nn.Module) -> None:
    """ZeRO gathers, reduces and steps parameters through floating buffers and float32 master
    shards, which would round an integer parameter (2**24 + 1 comes back 2**24) or fail on it
    deep in a copy-out kernel; such a parameter (frozen: an integer tensor cannot have a
    gradient) is refused by name when ZeRO is built, the same on every rank. FSDP likewise
    wants floating storage (QLoRA under FSDP stores its 4-bit weights as bfloat16 for it)."""
    bad = [(name, p.dtype) for name, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        listed = ", ".join(f"{name} ({str(dtype).removeprefix('torch.')})" for name, dtype in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise TypeError(
            f"ZeRO shards floating-point parameters only (gathered, reduced and stepped through floating "
            f"buffers and float32 master shards); {type(model).__name__} has {len(bad)} of another dtype: "
            f"{listed}{more}. An integer or boolean tensor cannot train: register it as a buffer "
            f"(module.register_buffer(name, tensor)), which every rank keeps whole, or use zero_stage=0 "
            f"(DataParallel)")


# Note [zero_grad through the model]: the optimizer steps ZeRO's shards, whose gradients the
# reductions accumulate into (a step without zero_grad in between keeps adding, as a plain
# .grad does). The model's own nn.Module.zero_grad clears its parameters' .grad - the full
# gradients - and not the shards': a loop written for the plain model (`model.zero_grad()`,
# transformers' Trainer among them) trained on the sum of every step's gradients so far
# (0.3-1.5 relative off the plain model's parameters after 5 SGD steps; review finding). So the
# wrapped model's zero_grad is ZeRO's: an instance attribute (the class stays the model's own,
# which transformers writes into config.json), holding ZeRO weakly. A deep copy of the model
# (an EMA copy) gets the plain nn.Module.zero_grad of its own parameters.
class _ZeroGradThrough:
    """`model.zero_grad` of a model a ZeRO (or a `parallelize`d layout over ZeRO) wraps."""

    def __init__(self, model: nn.Module, owner: nn.Module):
        self._model, self._owner = weakref.ref(model), weakref.ref(owner)

    def __call__(self, set_to_none: bool = True) -> None:
        owner, model = self._owner(), self._model()
        if owner is not None:
            owner.zero_grad(set_to_none=set_to_none)
        elif model is not None:  # the ZeRO was dropped: the model's own again
            nn.Module.zero_grad(model, set_to_none)

    def __reduce__(self):  # pickled (torch.save(model)): no ZeRO comes back, the model's own zero_grad does
        return functools.partial, (nn.Module.zero_grad, self._model())

    def __deepcopy__(self, memo):
        copied = memo.get(id(self._model()))  # the model being copied (registered before its attributes)
        if copied is None:
            return self
        owner = memo.get(id(self._owner()))  # the ZeRO copied with it (deepcopy(zero)): route to the copy
        return _ZeroGradThrough(copied, owner) if owner is not None else functools.partial(nn.Module.zero_grad, copied)


def route_zero_grad(model: nn.Module, owner: nn.Module) -> None:
    """Make `model.zero_grad(set_to_none)` call `owner.zero_grad(set_to_none=...)`, which clears
    ZeRO's shard gradients too (Note [zero_grad through the model])."""
    model.zero_grad = _ZeroGradThrough(model, owner)


class ZeRO(LocalAccumulation, nn.Module):
    def __init__(self, model: nn.Module, optimizer_factory: Callable, stage: int = 3, *,
                 group: dist.ProcessGroup | None = None, wrap: Callable[[nn.Module], bool] | None = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 reshard_after_forward: bool = True, prefetch: bool = True, offload_optimizer: bool = False):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be a callable that builds the optimizer from the parameters it "
                            f"is given (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), got "
                            f"{type(optimizer_factory).__name__}: ZeRO's optimizer steps this rank's shards of them, "
                            "which it puts in their place")
        check_dtypes(param_dtype, reduce_dtype)
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed to be initialised (init_parallel or init_process_group)")
        refuse_non_floating(model)
        self.module, self.stage, self.group = model, stage, group
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        release_frozen_hooks(model)  # a DataParallel's built before: ZeRO takes a parameter unfrozen later

        pool = BufferPool()  # every group's gather and reduce buffers (Note [CPU buffer reuse] in _group.py)

        def param_group(name: str, params: list[nn.Parameter], root: bool, group=group,
                        solo: bool = False) -> ParamGroup:
            # ZeRO-3 frees the wrapped modules' full parameters between uses; the root's and
            # ZeRO-1/2's stay, and at ZeRO-1/2 a master shard may be a view of them, as it may
            # for the experts' groups (`solo`: whole at every stage). Those are reduced once a
            # step, as ZeRO-2's are, so they take no pooled buffers (Note [CPU buffer reuse]).
            shared = _storage_shared_within(params)
            members = [ShardedParam(p, group, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                    keep_full=stage < 3 or root or solo, alias_full=stage < 3 or solo,
                                    offload=offload_optimizer,
                                    storage_shared_in_group=id(p) in shared) for p in params]
            for sp in members:  # every member took its shard from the shared storage: free it now
                if sp.storage_shared and not sp.keep_full:
                    sp.free_full()
            return ParamGroup(name, members)

        wrap = wrap or _default_wrap(model)
        shared = _shared_parameters(model)  # to the root group (Note [shared parameters])
        owned: set[int] = set(shared)
        self.groups: list[ParamGroup] = []
        module_group: dict[int, ParamGroup] = {}
        # One rank's experts (parallel_layers/expert_parallel.py) are split over their
        # expert-parallel ranks already: each experts module's go in a group of its own over
        # their replica group (the dp ranks holding the same experts; this rank alone when they
        # are spread over all of dp: no sharding, no collective), kept whole at every stage (at
        # ZeRO-1/2 the master is a view of the parameter), with the same optimizer and
        # checkpoints as the rest. No module hook gathers them: at ZeRO-3 the decoder layer
        # around them may be checkpointed, and a wrapped module inside a checkpointed block
        # would run its gather hooks again in the recompute. They are reduced in an order of
        # their own (Note [expert groups] in _hooks.py).
        owned.update(id(p) for p in model.parameters() if placement.expert_group(p) is not None)
        experts_groups = []
        for name, module in model.named_modules():
            experts = [p for p in module.parameters(recurse=False) if placement.expert_group(p) is not None]
            if experts:
                experts_groups.append(param_group(name, experts, root=False,
                                                  group=placement.expert_replica_group(experts[0]), solo=True))
                self.groups.append(experts_groups[-1])
                continue
            if module is model or not wrap(module):
                continue
            params = [p for p in module.parameters() if id(p) not in owned]
            if params:
                owned.update(id(p) for p in params)
                g = param_group(name, params, root=False)
                g.gather_for_backward = not _plain_lookup(module)  # Note [backward without parameters]
                self.groups.append(g)
                module_group[id(module)] = g
        rest = [p for p in model.parameters() if id(p) not in owned or id(p) in shared]
        self.root_group = param_group("<root>", rest, root=True) if rest else None
        if self.root_group is not None:
            self.groups.append(self.root_group)
        pooled = _pooled(self.groups) if stage == 3 else []
        for g in pooled:
            g.pool = pool
        pool.expect_units([g.members for g in pooled])
        self._stepped = False
        self.optimizer = _optimizer.build_over_shards(  # Note [an optimizer over shards] in _optimizer.py
            optimizer_factory, [(sp.full, sp.shard, sp.cut) for g in self.groups for sp in g.members], "ZeRO",
            replaced={id(p) for p in model.parameters()})
        self._hooks = ZeROHooks(model, self.groups, module_group, self.root_group, stage, prefetch=prefetch,
                                reshard_after_forward=reshard_after_forward, syncing=lambda: self._sync,
                                experts=experts_groups)
        if stage == 3:
            model.register_state_dict_pre_hook(_refuse_freed_parameters)
        route_zero_grad(model, self)  # Note [zero_grad through the model]

    def forward(self, *args, **kwargs):
        self._hooks.forget_failed_backward()  # Note [a backward that raised] in data_parallel.py
        if self.stage == 3 and self.root_group is not None:
            self.root_group.unshard()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside it (or `reduce_gradients()`,
        `clip_grad_norm_()`, `step()`) reduces the accumulated sum."""
        self._hooks.defer_reduction()
        with super().no_sync():
            yield

    def reduce_gradients(self) -> None:
        """Reduce-scatter now the full gradients accumulated under `no_sync()` into the shards:
        for a caller that runs several backwards per step (PipelineParallel)."""
        self._hooks.reduce_remaining()

    def clip_grad_norm_(self, max_norm: float, *, tp_group: dist.ProcessGroup | None = None,
                        pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Clip the (sharded) gradients by the global L2 norm of the whole model (over the
        data-parallel group, and the tensor- and pipeline-parallel groups when given); returns
        the norm before clipping."""
        self._hooks.reduce_remaining()
        return clip_grad_norm_(self.module, max_norm, data_parallel=self, tp_group=tp_group, pp_group=pp_group)

    def profiler_check(self) -> None:
        """Called where a step starts without a forward of the wrapped model (a pipeline calls its
        stages): freed parameters unmarked while torch.profiler's Python tracer runs (Note
        [reading a freed parameter] in _param.py)."""
        self._hooks.profiler_check()

    def step(self) -> None:
        if not self._stepped:  # once: a meta-built model's optimizer state (the step would fail obscurely)
            _optimizer.check_state_has_storage(self.optimizer, "ZeRO.step")
            self._stepped = True
        self._hooks.reduce_remaining()
        self._hooks.drop_gradients_no_rank_made()  # Note [a parameter no rank used] in _hooks.py
        self._cast_state_of_promoted_shards()
        for g in self.groups:
            g.drop_prefetch()
            if not g.keep_full:  # Note [last group stays gathered] in _hooks.py: nothing stale survives the step
                g.reshard()
        self.optimizer.step()
        for g in self.groups:
            if g.keep_full:
                g.refresh_stepped()  # the others gather at their next use
        self._hooks.after_step()

    def _cast_state_of_promoted_shards(self) -> None:
        """Optimizer state the optimizer's constructor built for a shard that was frozen then
        (Adagrad's sum, in the frozen dtype) follows it to float32 (Note [frozen shards keep
        their dtype] in _param.py)."""
        for g in self.groups:
            for sp in g.promoted:
                state = self.optimizer.state.get(sp.shard, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == sp.shard.shape:
                        state[key] = value.to(torch.float32)
            g.promoted.clear()

    def skip_step(self) -> None:
        """A step that changes nothing (float16 gradients that overflowed, Note [one loss scale for
        every rank]): the gradients are reduced and dropped by zero_grad, the parameters stay."""
        self._hooks.reduce_remaining()
        self._hooks.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shard gradients (which the next step's reductions accumulate into) and the full
        ones; zero them in place with set_to_none=False, as nn.Module.zero_grad does."""
        self._hooks.forget_failed_backward()  # what a backward that raised left in flight lands first
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for g in self.groups:
            for sp in g.members:
                _grad_bank.set_banked(sp.full, None)  # Note [accumulating in the reduce dtype] in _param.py
            for p in g.params:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._hooks.forget_uses()

    # ---- state (_state.py) -----------------------------------------------------------------
    def state_placement(self, prefix: str = "") -> placement.ModelPlacement:
        """What this rank holds of the model (parallel_layers.placement): each parameter as its
        float32 master shard, a flat element range of the (TP-local) parameter; buffers as
        the module has them. Writing into the shards must be followed by `after_load`."""
        return _state.state_placement(self, prefix)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter gathered (a collective)."""
        return _state.full_state_dict(self)

    def sharded_state_dict(self) -> dict:
        """This rank's shards and optimizer state (no collective): save one per rank, load it
        back with `load_sharded_state_dict` at the same world size and wrap policy."""
        return _state.sharded_state_dict(self)

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what `sharded_state_dict` returned on this rank (a collective: every rank
        raises if any rank's state does not fit)."""
        _state.load_sharded_state_dict(self, state)

    def materialize(self, device: torch.device | str) -> None:
        """A model built on the meta device gets zero-filled storage on `device`, in place:
        this rank's master shards (on the CPU when offloaded), the full parameters (left freed
        at stage 3) and the module's buffers (parallel_layers/meta.py). Write the shards (e.g.
        `hf.load_pretrained`, a checkpoint load) before training."""
        _state.materialize(self, device)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: full params, full grads, master shards (not counting those
        that are views of full params), shard grads, optimizer state, and the CPU memory kept
        for reuse (`pooled`: buffers and freed parameters' memory)."""
        return _state.memory_bytes(self)


__all__ = ["ZeRO"]
