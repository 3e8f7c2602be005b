"""Models built on the meta device: give their tensors storage without losing who refers to them.

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)   # no memory
    par = parallelize(model, ctx, ...)                                     # TP shards, ZeRO shards: still meta
    hf.load_pretrained(directory, par)        # materialize(...) on ctx.device, then the files' values

`materialize(model, device)` gives every meta tensor of `model` zero-filled storage on
`device`; the values are the caller's to write (hf.load_pretrained does). Wrappers that hold
tensors of their own, or must not allocate what they hold (ZeRO-3's freed full parameters),
implement `materialize(device)` themselves, as they implement `state_placement` for
parallel_layers.placement: ZeRO allocates its flat shards and leaves the full parameters
freed, DataParallel rebuilds its gradient buckets.

Note [materialize in place]: by the time a model is materialised, its meta tensors are
referred to from everywhere: the optimizer's parameter groups, DataParallel's buckets and
gradient hooks, ZeRO's ShardedParams and hooks, tensor parallelism's attributes
(`tp_shard`, the placement layout) and its gradient hooks, a head tied to the embedding.
`nn.Module.to_empty` makes new Parameter objects (the meta and CPU tensor types are not
compatible for `param.data = ...`), and even with torch's swap_module_params_on_conversion
the attributes and hooks stay behind on the old object. So each tensor is swapped in place
(`torch.utils.swap_tensors`: the Python object keeps its identity and takes the new storage),
then given back its attributes and its gradient hooks, which autograd keeps on the tensor's
implementation, not on the Python object: re-assigning `_backward_hooks` and
`_post_accumulate_grad_hooks` registers the same hook dicts (and so the same handles) with the
new one. Nothing may have run backward on the meta tensors (it cannot: they hold no data).
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.nn as nn
from torch import Tensor


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` (or a tensor its wrapper holds, such as
    ZeRO's shards, through `placement.describe`, or DataParallel's gradient buckets) is on the
    meta device."""
    from parallel_layers import placement

    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return True
    # DataParallel's gradient buckets, built on the meta device with the model: still there when
    # the model alone was materialized, not the wrapper that rebuilds them (review finding: the
    # first step failed "Cannot copy out of meta tensor")
    if any(b.buffer.is_meta for b in getattr(model, "buckets", ())):
        return True
    if not callable(getattr(model, "state_placement", None)):
        return False
    return any(tp.local.is_meta for tp in placement.describe(model).tensors.values())


def swap_in(old: Tensor, new: Tensor) -> None:
    """Make `old` (the same Python object) hold `new`'s storage, device and dtype, keeping its
    attributes and gradient hooks (Note [materialize in place])."""
    if type(new) is not type(old):
        new = nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new
    attrs = dict(old.__dict__)
    backward_hooks, post_accumulate_hooks = old._backward_hooks, old._post_accumulate_grad_hooks
    torch.utils.swap_tensors(old, new)
    old.__dict__.update(attrs)
    if backward_hooks is not None:
        old._backward_hooks = backward_hooks
    if post_accumulate_hooks is not None:
        old._post_accumulate_grad_hooks = post_accumulate_hooks


def empty_like(t: Tensor, device: torch.device | str) -> Tensor:
    """Zero-filled storage for `t` on `device`, of its shape and dtype. Zeros, not torch.empty:
    the files do not cover every element a rank holds (a vocabulary padded to a multiple of
    tp has rows no checkpoint has, zero in the constructor), and one memset is nothing next to
    reading the weights."""
    new = torch.zeros(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def materialize_module(module: nn.Module, device: torch.device | str, skip: set[int] = frozenset()) -> None:
    """Give every meta parameter and buffer of `module` (except the ids in `skip`) zero-filled
    storage on `device`, in place; a tensor held under several names (tied) once."""
    done: set[int] = set()
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for t in table.values():
                if t is None or not t.is_meta or id(t) in skip or id(t) in done:
                    continue
                swap_in(t, empty_like(t, device))
                done.add(id(t))
    for m in module.modules():  # tensors that share one allocation (SwiGLUMLP's gate and up) get it back
        pack = getattr(m, "pack_", None)
        if callable(pack) and any(id(p) in done for p in m.parameters()):
            pack()


def materialize(model: nn.Module, device: torch.device | str, *, warn_unfilled_buffers: bool = True) -> None:
    """Give every meta tensor of `model` (plain, tensor parallel, or wrapped by ZeRO or
    DataParallel) zero-filled storage on `device`, in place (Note [materialize in place]);
    every reference to them - optimizer, wrappers, hooks, ties - stays valid. Wrappers implement
    `materialize(device)`; other modules get `materialize_module`.

    Non-persistent buffers (a rotary embedding's inv_freq, Gemma's embed_scale) are in no
    checkpoint, so zeros would stay: they are warned about, unless the caller computes them
    (hf.materialize and hf.load_pretrained do, from the model's constructor)."""
    unfilled = _meta_non_persistent_buffers(model) if warn_unfilled_buffers else []
    hook = getattr(model, "materialize", None)
    if callable(hook):
        hook(device)
    else:
        materialize_module(model, device)
    if unfilled:
        warnings.warn(f"meta.materialize: {len(unfilled)} non-persistent buffer(s) are zeros now and no checkpoint "
                      f"holds them: {unfilled[:4]}; compute them before training (hf.materialize(model) does so for a "
                      "Hugging Face model)", RuntimeWarning, stacklevel=2)


def _meta_non_persistent_buffers(model: nn.Module) -> list[str]:
    return [f"{name}.{b}" if name else b for name, m in model.named_modules() for b, t in m._buffers.items()
            if t is not None and t.is_meta and b in m._non_persistent_buffers_set]


__all__ = ["has_meta", "materialize", "materialize_module", "swap_in"]
