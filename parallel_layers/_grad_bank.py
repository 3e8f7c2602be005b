"""A parameter's gradient of earlier backward passes, kept in a wider dtype than its .grad
(Note [accumulating in the reduce dtype] in zero/_param.py).

ZeRO under `param_dtype` banks a bfloat16 parameter's gradient here, in float32, when autograd
is about to add a second backward pass's into its .grad, and adds each later pass's to the bank
as soon as it is made: one backward pass a step holds a bfloat16 .grad (2 bytes a parameter),
several hold the float32 bank (4 bytes), as FSDP2 holds an unsharded gradient it accumulates
without reducing, and Megatron its main_grad, not the bank and a .grad (6 bytes). What reads a parameter's whole
gradient before ZeRO reduces it - the pipeline's sum of a tied weight's copies over its stages
(Note [tied parameters] in pipeline/stages.py) - takes the bank and the .grad together. The bank
lives on the parameter, so both see one.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BANK, _DTYPE = "_pl_grad_bank", "_pl_grad_bank_dtype"


def enable(p: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """Bank `p`'s gradient in `dtype` before each further backward pass adds to it - from when it
    is unfrozen, for a `p` that does not require grad now."""
    setattr(p, _DTYPE, dtype)
    setattr(p, _BANK, None)
    frozen = not p.requires_grad
    p.requires_grad_(True)  # autograd takes a hook only then, and keeps it when the flag goes
    p.register_hook(lambda grad: _bank(p, grad))
    p.register_post_accumulate_grad_hook(_fold)
    p.requires_grad_(not frozen)


def dtype_of(p: torch.nn.Parameter) -> torch.dtype | None:
    """The bank's dtype, or None where `p`'s gradient is not banked."""
    return getattr(p, _DTYPE, None)


def banked(p: torch.nn.Parameter) -> Tensor | None:
    return getattr(p, _BANK, None)


def set_banked(p: torch.nn.Parameter, t: Tensor | None) -> None:
    setattr(p, _BANK, t)


def _bank(p: torch.nn.Parameter, grad: Tensor) -> Tensor:
    held = p.grad
    if held is not None:
        bank = banked(p)
        set_banked(p, held.to(dtype_of(p)) if bank is None else bank.add_(held))
        p.grad = None  # autograd now stores `grad` as it is
    return grad


def _fold(p: torch.nn.Parameter) -> None:
    """Once a bank holds `p`'s gradient, each later backward pass's is added to it as soon as it is
    made: the bank and a .grad of the parameter's size are never both held."""
    bank = banked(p)
    if bank is not None and p.grad is not None:
        bank.add_(p.grad)
        p.grad = None


def take(p: torch.nn.Parameter) -> Tensor | None:
    """The whole gradient of a parameter whose gradient is banked - the bank plus .grad, in the
    bank's dtype - leaving neither; None if there is none."""
    bank, grad = banked(p), p.grad
    set_banked(p, None)
    p.grad = None
    if bank is None:
        return grad.to(dtype_of(p)) if grad is not None else None
    return bank.add_(grad) if grad is not None else bank
