"""The optimizer a wrapper builds from its factory, checked: it must step only the tensors it
was given. An optimizer built before `parallelize` or ZeRO holds the model's parameters as they
were; tensor parallelism replaces them with their shards and ZeRO with its own, so its step
would update tensors nothing reads any more while the ones that train get no update: a loss
that drifts from the plain model's, with no error (review finding)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def build(factory: Callable, params: Sequence[torch.Tensor], who: str, replaced: set[int]):
    """`factory(list(params))`, without other stages' parameters (`_drop_unheld`), checked by `check`."""
    opt = factory(list(params))
    _drop_unheld(opt, params)
    check(opt, params, who, replaced)
    return opt


def _drop_unheld(opt, params: Sequence[torch.Tensor]) -> None:
    """Take out of the optimizer's groups the tensors on the meta device that it was not given:
    under a pipeline, the other stages' parameters, which a factory grouping the whole model by
    name (`model.named_parameters()`, as transformers' Trainer does) includes. They never train
    here, and a checkpoint of the optimizer found no placement for them (review finding: "the
    optimizer steps a tensor ... that is not a parameter of the model")."""
    given = {id(p) for p in params}
    state = getattr(opt, "state", {})
    for group in getattr(opt, "param_groups", ()):
        dropped = [p for p in group["params"] if p.is_meta and id(p) not in given]
        if dropped:
            group["params"][:] = [p for p in group["params"] if not p.is_meta or id(p) in given]
            for p in dropped:  # state an optimizer built in its constructor (Adagrad) goes with them
                state.pop(p, None)


# Note [an optimizer over shards]: ZeRO's optimizer steps this rank's flat float32 shards, but
# the recipes people bring group parameters by what they are - by name (transformers' Trainer:
# no weight decay for biases and norm weights) or by dimension (nanoGPT: decay what has
# p.dim() >= 2) - and a shard has neither: handed the shards, a Trainer-style factory put every
# one in the decay group, a nanoGPT-style one none (review finding; no error, only a different
# model). So the factory is called with the model's own parameters, which have their names,
# shapes and dtypes, and each is then replaced, in place in its group's list, by its shard, as
# DeepSpeed's ZeRO takes the user's parameter groups and flattens each into shards. The
# optimizer's settings per group stay as the factory made them. The factory must not read the
# parameters' values (ZeRO-3 has freed them: that raises). Most torch.optim optimizers create
# their state at the first step, from the shards; one that creates it in its constructor
# (Adagrad's accumulator) has it cut as the shards are - once, allocated at the full size, in
# the parameters' dtype (with param_dtype=bfloat16 its initial value is rounded to bfloat16
# before it becomes float32), and on a model built on the meta device it has no values, which
# the first step refuses (check_state_has_storage).
# Optimizers whose update depends on each parameter's shape, or on all of them at once, by class
# name (torch.optim's, transformers', and the usual third-party ones): on ZeRO's flat 1-D
# shards Adafactor keeps a full second moment where it factors a matrix's and scales its step
# by the shard's RMS, Muon orthogonalises 2-D matrices, Shampoo / SOAP / GaLore precondition
# or project them, LBFGS takes dot products over all parameters (review finding: Adafactor
# 1.35e-2 off the plain model in 3 steps with no error; Muon failed "Param gradient must be a
# 2D matrix" on 2-D parameters).
_SHAPE_DEPENDENT = frozenset(["Adafactor", "Muon", "LBFGS", "Shampoo", "DistributedShampoo", "SOAP", "GaLoreAdamW",
                              "GaLoreAdamW8bit", "GaLoreAdafactor"])


def refuse_shape_dependent(opt, who: str) -> None:
    """Raise (on every rank: the same factory everywhere) for an optimizer that cannot step flat shards."""
    name = type(opt).__name__
    if name in _SHAPE_DEPENDENT:
        raise ValueError(
            f"{who}: {name} computes its update from each parameter's shape (or from all parameters at once), but "
            f"ZeRO steps this rank's flat 1-D shards of them, where it would compute something else or fail. With "
            f"ZeRO use an optimizer whose update is elementwise (AdamW, Adam, SGD, Adagrad, RMSprop, Lion, ...); to "
            f"train with {name}, use zero_stage=0 (DataParallel), tensor or pipeline parallelism")


def build_over_shards(factory: Callable, members: Sequence[tuple[torch.Tensor, torch.Tensor, Callable]], who: str,
                      replaced: set[int]):
    """`factory([full, ...])` for `members` = (full parameter, its shard, cut), each full parameter
    then replaced by its shard and its state by `cut(state)` (Note [an optimizer over shards]),
    checked by `check`."""
    opt = factory([full for full, _, _ in members])
    refuse_shape_dependent(opt, who)
    shard_of = {id(full): (shard, cut) for full, shard, cut in members}
    for group in getattr(opt, "param_groups", ()):  # in place: LBFGS keeps the list
        group["params"][:] = [shard_of[id(p)][0] if id(p) in shard_of else p for p in group["params"]]
    state = getattr(opt, "state", None)
    for full, shard, cut in members if state else ():
        if full in state:
            state[shard] = {k: cut(v) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == full.shape else v
                            for k, v in state.pop(full).items()}
    shards = [shard for _, shard, _ in members]
    _drop_unheld(opt, shards)
    check(opt, shards, who, replaced)
    return opt


def check_state_has_storage(opt, who: str) -> None:
    """Raise before a step when the optimizer holds state on the meta device: an optimizer that
    builds its state in its constructor (Adagrad's accumulator) over a model built on the meta
    device keeps it there when the weights are loaded (review finding: the step failed with
    'Tensor on device cpu is not on the expected device meta!')."""
    meta = [type(v).__name__ for st in getattr(opt, "state", {}).values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.is_meta]
    if meta:
        raise RuntimeError(
            f"{who}: the optimizer ({type(opt).__name__}) holds {len(meta)} state tensor(s) on the meta device: it built "
            "them in its constructor over a model built on the meta device, and loading the weights gave the "
            "parameters storage, not the optimizer's state. Resume from a checkpoint (checkpoint.load fills the state), "
            "build the model for real, or use an optimizer that creates its state at the first step (SGD, Adam, AdamW)")


def check(opt, params: Sequence[torch.Tensor], who: str, replaced: set[int]) -> None:
    """Raise, alike on every rank (every rank builds it from the same code), when `opt` steps a
    tensor that `who` replaced by `params`: the ids in `replaced` (the model's parameters before
    it) that are not among `params` and still hold values. Other tensors the factory may add (a
    learnable loss temperature) are its own business; another pipeline stage's parameters, left
    on the meta device, were dropped (`_drop_unheld`)."""
    given = {id(p) for p in params}
    stepped = [p for group in getattr(opt, "param_groups", ()) for p in group["params"]]
    stale = [p for p in stepped if id(p) not in given and id(p) in replaced and not p.is_meta]
    if stale:
        raise ValueError(
            f"{who}: the optimizer the factory built steps {len(stale)} of the model's parameters as they were before "
            f"{who} replaced them (shapes {[tuple(p.shape) for p in stale[:3]]}), not the {len(given)} tensors it was "
            "given. Build it inside the factory from the parameters passed to it (optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=...)): one built before holds the model's parameters as they were, which "
            "tensor parallelism and ZeRO replace, and would train them silently wrong")
