"""The optimizer a wrapper builds from its factory, checked: it must step only the tensors it
was given. An optimizer built before `parallelize` or ZeRO holds the model's parameters as they
were; tensor parallelism replaces them with their shards and ZeRO with its own, so its step
would update tensors nothing reads any more while the ones that train get no update: a loss
that drifts from the plain model's, with no error (review finding)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def build(factory: Callable, params: Sequence[torch.Tensor], who: str, replaced: set[int]):
    """`factory(list(params))`, checked by `check`."""
    opt = factory(list(params))
    check(opt, params, who, replaced)
    return opt


def check(opt, params: Sequence[torch.Tensor], who: str, replaced: set[int]) -> None:
    """Raise, alike on every rank (every rank builds it from the same code), when `opt` steps a
    tensor that `who` replaced by `params`: the ids in `replaced` (the model's parameters before
    it) that are not among `params` and still hold values. Other tensors the factory may add (a
    learnable loss temperature; another pipeline stage's parameters, left on the meta device,
    which get no gradient) are its own business."""
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
