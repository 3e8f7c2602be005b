"""The parity tests' two sides: the reference trained in one process, and the parameters a
parallel rank trains, whole."""

from __future__ import annotations

import torch
import torch.nn as nn


def trained_parameters(model: nn.Module, par, ctx) -> dict[str, torch.Tensor]:
    """The parameters this rank trains under `par` (a Parallelized), gathered over tp, under the
    unparallelized model's names (ZeRO: its full state dict; otherwise the model's tensors that
    this rank's module holds, e.g. its pipeline stages')."""
    from parallel_layers import ZeRO
    from parallel_layers.tensor_parallel import gather_full

    originals = model.state_dict(keep_vars=True)
    held = {id(p) for p in par.module.parameters()}
    state = par.module.full_state_dict() if isinstance(par.module, ZeRO) else \
        {n: t for n, t in originals.items() if id(t) in held}
    return {n: gather_full(t, ctx.tp_group, getattr(originals[n], "tp_shard", None)) for n, t in state.items()}


def train_one_process(model: nn.Module, loss_fn, optimizer, ids, targets, clip: float):
    """The reference: `len(ids)` steps of the unparallelized model in this process, clipping at
    `clip`; returns the losses, the gradient norms before clipping and the final state dict."""
    losses, norms = [], []
    for step_ids, step_targets in zip(ids, targets):
        loss = loss_fn(model(step_ids), step_targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}
