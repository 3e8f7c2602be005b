"""Activation checkpointing of a model's blocks, step 2 of `parallelize` (Note [parallelize order]).

    checkpoint_blocks(model, "selective", lambda m: isinstance(m, Block))   # in place

Each selected block's forward runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
and is recomputed, block by block, during backward:

  "full"       nothing inside the block is kept for backward: only its inputs (held for the
               recompute). The recompute re-runs the whole block, its TP collectives included.
  "selective"  the outputs of the block's linear layers' GEMMs are kept - aten mm / addmm, and
               the library's fused GEMM + bias + GeLU (torch.ops.parallel_layers.linear_gelu: it
               is a GEMM, so its outputs - the GeLU and the pre-activation - are kept together,
               as one op's outputs are) - and those of the fused attention kernels
               (scaled_dot_product_*: two GEMMs' work, O(seq) memory); the elementwise ops
               around them (norms, activations, residual adds, rotary embeddings, casts) are
               recomputed, and so is attention's core on the math path (bmm / baddbmm, softmax,
               dropout: O(seq^2) memory, cheap to redo), as in Megatron's selective recompute
               (Korthikanti et al., 2022) and as parallel_layers.plan estimates "selective".
               The op-level policy of torchtitan's `activation_checkpoint.mode = "selective"`
               (which keeps mm too, not bmm), through torch's
               `create_selective_checkpoint_contexts`. See Note [selective writes].

Note [checkpoint inside the hooks]: the block's `forward` is checkpointed, not its `__call__`,
so the module hooks around it (ZeRO-3's gather before forward, free after, backward pre-hook
and the marker that reduces its gradients) run once per forward and are not run again by the
recompute. The recompute happens while the block's backward runs: ZeRO-3 has gathered the
parameters again for that backward (its pre-backward hook fires on the gradient of the block's
output, before any node of the block unpacks a saved tensor), so the recomputed forward reads
full parameters, which ZeRO frees after the block's backward as it would without checkpointing;
the prefetch order (recorded by the first forward's hooks) and the reductions (one per group,
on the backward marker) are unchanged, so no gradient is reduced twice. Hugging Face's
GradientCheckpointingLayer checkpoints `forward` for the same reason (FSDP2's hooks).

Note [recompute collectives]: the TP layers' autograd Functions all-gather / all-reduce /
reduce-scatter in forward. A recompute re-runs the block's forward as it ran, so every rank of
the TP group runs the same collectives in the same order: the blocks are recomputed in backward
order, which is the same program on every rank, and the selective policy's choices depend only
on the op sequence, never on values. "full" repeats every forward collective of the block in
backward; "selective" skips those that wrote into a kept GEMM output (the row layer's all-reduce,
Note [selective writes]) and repeats those that write into a fresh buffer (sequence parallelism's
all-gather and reduce-scatter).

RNG: `checkpoint` stashes the CPU and device RNG states at forward and restores them for the
recompute (preserve_rng_state), so dropout draws the same mask twice and the global RNG stream
is what it would be without checkpointing. The per-rank streams of the TP regions
(tensor_parallel/region_random.py) are stashed and replayed the same way. "selective" keeps no
op that draws (Note [kept ops that draw]): skipped in the recompute, it would leave the draws
after it one mask behind.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel_layers.tensor_parallel import region_random

MODES = ("full", "selective")

_aten = torch.ops.aten
# Ops whose outputs "selective" keeps: the linear layers' GEMMs (a linear of any rank is an mm /
# addmm over its flattened input; bmm is attention's QK^T and AV, recomputed), the fused
# attention kernels, the library's fused GEMM + bias + GeLU. Only functional overloads: an out=
# GEMM writes into a buffer whose allocation is recomputed, and skipping the GEMM in the
# recompute would leave it unwritten.
_GEMMS = frozenset(
    [_aten.mm.default, _aten.addmm.default]
    + [getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable") if hasattr(_aten, name)])
_FUSED_GEMMS = ("linear_gelu",)  # torch.ops.parallel_layers.<name>.default, resolved once the library is loaded


def check_mode(mode) -> None:
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise ValueError(f"activation_checkpointing must be one of None, {', '.join(map(repr, MODES))} (per block: "
                         f"'full' recomputes the whole block in backward, 'selective' keeps its GEMM outputs and "
                         f"recomputes the rest), got {mode!r}")


def check_arguments(mode, is_block) -> None:
    """The checks that need no model: `parallelize` makes them before any collective."""
    check_mode(mode)
    if mode is not None and is_block is None:
        raise ValueError(f"activation_checkpointing={mode!r} checkpoints the blocks that wrap= selects (the modules "
                         "ZeRO groups its parameters by; a Hugging Face model's default: the classes in its "
                         "_no_split_modules); pass wrap=, e.g. wrap=lambda m: isinstance(m, Block)")


def checkpoint_blocks(model: nn.Module, mode: str, is_block: Callable[[nn.Module], bool] | None) -> list[str]:
    """Checkpoint, in place, the forward of every module of `model` that `is_block` selects;
    returns their names. The blocks must not nest (a recompute would re-run an inner block's
    module hooks, ZeRO-3's gathers among them)."""
    check_arguments(mode, is_block)
    if mode is None:
        return []
    blocks = [(name, m) for name, m in model.named_modules() if is_block(m)]
    if not blocks:
        raise ValueError(f"activation_checkpointing={mode!r}: wrap= selects no module of {type(model).__name__}, so "
                         "there is no block to checkpoint")
    for name, m in blocks:
        inner = [f"{name}.{n}" if name else n for n, sub in m.named_modules() if sub is not m and is_block(sub)]
        if inner:
            raise ValueError(f"activation_checkpointing={mode!r}: wrap= selects {inner[0]!r} inside the block "
                             f"{name!r}; checkpointed blocks must not nest (the recompute of {name!r} would run "
                             f"{inner[0]!r}'s hooks again): select one level, e.g. the transformer blocks")
        if getattr(m, "_pl_activation_checkpointing", None) is not None:
            raise ValueError(f"activation checkpointing is already applied to {name!r} "
                             f"({m._pl_activation_checkpointing!r})")
        if getattr(m, "gradient_checkpointing", False) is True:  # Hugging Face's GradientCheckpointingLayer
            raise ValueError(f"activation_checkpointing={mode!r}: {name!r} has the model's own gradient checkpointing "
                             "on (gradient_checkpointing_enable()); use one of the two, not both (the block would be "
                             "recomputed twice)")
    # A key/value cache filled in forward would be filled a second time by the recompute (and
    # the recomputed attention would read both): a forward with autograd on runs without one, as
    # under Hugging Face's own gradient checkpointing, which also decides it per call. The config is
    # left alone (review finding: setting config.use_cache = False was written into the exported
    # config.json and generation_config.json, and the reloaded model generated without a cache).
    for m in model.modules():  # the model, or the transformers model a user's wrapper holds
        position = _use_cache_position(m)
        if position is not None and getattr(getattr(m, "config", None), "use_cache", False) and \
                not hasattr(m, "_pl_no_training_cache"):
            m._pl_no_training_cache = m.register_forward_pre_hook(
                functools.partial(_no_cache_in_training, position=position), with_kwargs=True)
    for _, m in blocks:
        _checkpoint_forward(m, mode)
    return [name for name, _ in blocks]


def _use_cache_position(model: nn.Module) -> int | None:
    """Where `model.forward` takes `use_cache` by position (a large number if only by keyword),
    or None when it takes no such argument (a user's wrapper around a transformers model: review
    finding, the hook's keyword was refused)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "use_cache" not in parameters:
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [name for name, p in parameters.items() if p.kind in kinds]
    return positional.index("use_cache") if "use_cache" in positional else len(parameters) + 1_000


def _no_cache_in_training(module: nn.Module, args, kwargs, *, position: int):
    # a forward that records for backward, whose blocks the backward recomputes (a model from
    # from_pretrained trains in eval mode unless the user calls train(): not module.training)
    if not torch.is_grad_enabled():
        return None
    if len(args) > position:  # given by position
        return (*args[:position], False, *args[position + 1:]), kwargs
    return args, {**kwargs, "use_cache": False}


def _call(forward, args, kwargs):
    return forward(*args, **kwargs)


def _checkpointed_forward(self, *args, **kwargs):
    """The block's forward under checkpoint (bound to the block by `_checkpoint_forward`)."""
    forward = self._pl_forward  # the forward it replaced
    if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
        return forward(*args, **kwargs)
    # The arguments travel as checkpoint's own (args, kwargs), so that it finds every tensor's
    # device for the RNG states (it scans its positional arguments), and so that no keyword of
    # the block collides with checkpoint's (debug=, context_fn=, ...).
    # respect_saved_tensors_hooks: what "selective" keeps goes through the caller's
    # saved-tensor hooks (save_on_cpu, memory accounting) like every other saved tensor.
    extra = {"context_fn": _selective_contexts} if self._pl_activation_checkpointing == "selective" else {}
    return checkpoint(_call, _replaying_region_draws(forward), args, kwargs, use_reentrant=False,
                      preserve_rng_state=True, respect_saved_tensors_hooks=True, **extra)


def _replaying_region_draws(forward):
    """`forward`, whose later calls (the recomputes) start the TP region streams where the
    first call found them (Note [a random stream per rank inside TP regions])."""
    states, calls = region_random.snapshot(), [0]

    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            return forward(*args, **kwargs)
        with region_random.replaying(states):
            return forward(*args, **kwargs)
    return run


def _checkpoint_forward(module: nn.Module, mode: str) -> None:
    """Note [checkpoint inside the hooks]: replace the instance's forward, which
    `nn.Module.__call__` runs between the module's hooks. The replacement is a partial over the
    module and the forward it calls a method bound to it (or an instance override already
    there), so a deep copy or a pickled model calls its own (a bound method of a function the
    module has no attribute for would not pickle). A shallow copy calls the original's."""
    module._pl_forward = module.forward  # the class's forward, or an instance override already there
    module._pl_activation_checkpointing = mode
    module.forward = functools.partial(_checkpointed_forward, module)


def _selective_contexts():
    # allow_cache_entry_mutation: the policy allows writes into kept outputs on its own terms
    # (Note [selective writes]) and refuses the ones that would make the recompute wrong.
    return create_selective_checkpoint_contexts(_SelectivePolicy(), allow_cache_entry_mutation=True)


@functools.cache
def _gemms() -> frozenset:
    fused = [getattr(torch.ops.parallel_layers, name, None) for name in _FUSED_GEMMS]
    return _GEMMS | {op.default for op in fused if op is not None}


# Note [kept ops that draw]: on a GPU the fused attention kernels (flash, memory-efficient, cuDNN)
# draw their dropout from the device's generator themselves. Kept, such an op is not run in the
# recompute, which then never advances the generator past it: every later draw of the block
# (GPT-2's residual dropout after its attention) got another mask than its forward did, and the
# gradients were silently wrong; checkpoint's restored RNG state cannot help, as the recompute
# skips a draw, not a state. So a kept op that draws - tagged nondeterministic_seeded, with a
# dropout_p above 0 where it has one - is recomputed, and draws the forward's mask again, as
# Megatron's selective recomputation recomputes the core attention. Without dropout the fused
# attention is kept as before.
def _draws(func, args, kwargs) -> bool:
    """Whether the op draws random numbers in this call (Note [kept ops that draw])."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return p is not None and p > 0
    return True


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()  # a freed ZeRO-3 one's data_ptr raises
            and t.untyped_storage().data_ptr() != 0}


def _written(func, args, kwargs) -> set[int]:
    """Storages the op writes into. torch.distributed's c10d ops declare no writes in their
    schemas (c10d::allreduce_(Tensor[] tensors, ...) is "not mutable"); each writes its first
    argument (the in-place tensors, or the output of a gather / scatter), except send."""
    schema = func._schema
    if func.namespace == "c10d":
        return _storages(args[:1]) if schema.name not in ("c10d::send", "c10d::barrier") else set()
    written = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written |= _storages(value)
    return written


class _SelectivePolicy:
    """The selective policy of one checkpointed call: keep the GEMMs' outputs, recompute the
    rest, and handle writes into what is kept (Note [selective writes]).

    Note [selective writes]: torch's selective checkpointing keeps an op's output by reference
    and, in the recompute, hands that same tensor back instead of running the op. An op that
    later writes into it in place - the row-parallel layer's all-reduce of its GEMM output and
    the bias added to the sum, both in the GEMM's buffer to spare a copy - has then already
    written the kept tensor: recomputing the write would apply it twice (the all-reduce would
    sum the sum over the TP group). So a write into a kept storage is kept too: the recompute
    skips it (no collective, no second add_), and the kept storage holds the value after every
    write, which is what the code after the last write reads. A recomputed op that reads a kept
    storage and is followed by a write into it would read the later value in the recompute:
    that is refused, as is a kept write that also writes a storage that is not kept (skipping
    it would leave that one unwritten). Views of a kept storage are recomputed (they alias the
    kept tensor, and read nothing). torch's own check of the kept tensors' version counters
    would miss the all-reduce (c10d ops bump no version counter); this policy sees every write.
    """

    def __init__(self):
        self.kept: dict[int, str | None] = {}  # kept storage -> the recomputed op that read it last, if any
        self.gemms = _gemms()

    def __call__(self, ctx, func, *args, **kwargs):
        written = _written(func, args, kwargs)
        into_kept = written & self.kept.keys()
        if into_kept:
            reader = next((self.kept[p] for p in into_kept if self.kept[p] is not None), None)
            if reader is not None:
                raise RuntimeError(f"activation_checkpointing='selective': {func} writes in place into the output of "
                                   f"a kept GEMM that {reader} read before; the recompute of {reader} would read the "
                                   "written value. Use activation_checkpointing='full' for this model")
            if written - into_kept:
                raise RuntimeError(f"activation_checkpointing='selective': {func} writes into the output of a kept "
                                   "GEMM and into another tensor; the recompute cannot skip the one and redo the "
                                   "other. Use activation_checkpointing='full' for this model")
            return CheckpointPolicy.MUST_SAVE
        out = _storages(ctx.op_output)
        if func in self.gemms and not written and not _draws(func, args, kwargs):
            for p in out:
                self.kept[p] = None
            return CheckpointPolicy.MUST_SAVE
        read = _storages((args, kwargs)) & self.kept.keys()
        if read and not (out & read):  # a view of a kept tensor reads nothing
            for p in read:
                self.kept[p] = str(func)
        return CheckpointPolicy.PREFER_RECOMPUTE
