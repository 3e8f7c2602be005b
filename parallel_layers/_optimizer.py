"""The optimizer a wrapper builds from its factory, checked: it must step only the tensors it
was given. An optimizer built before `parallelize` or ZeRO holds the model's parameters as they
were; tensor parallelism replaces them with their shards and ZeRO with its own, so its step
would update tensors nothing reads any more while the ones that train get no update: a loss
that drifts from the plain model's, with no error (review finding)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def build(factory: Callable, params: Sequence[torch.Tensor], who: str):
    """`factory(list(params))`, or an error raised alike on every rank (every rank builds it
    from the same code) when it steps a tensor that is not one of `params`."""
    opt = factory(list(params))
    given = {id(p) for p in params}
    stepped = [p for group in getattr(opt, "param_groups", ()) for p in group["params"]]
    foreign = [p for p in stepped if id(p) not in given]
    if foreign:
        raise ValueError(
            f"{who}: the optimizer the factory built steps {len(foreign)} of its {len(stepped)} tensors that are not "
            f"among the {len(given)} it was given (shapes {[tuple(p.shape) for p in foreign[:3]]}). Build it inside "
            "the factory from the parameters passed to it (optimizer=lambda params: torch.optim.AdamW(params, "
            "lr=...)): one built before holds the model's parameters as they were, which tensor parallelism and "
            "ZeRO replace, and would train them silently wrong")
    return opt
