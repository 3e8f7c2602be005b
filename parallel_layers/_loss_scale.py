"""Loss scaling for float16 training, one scale for every rank.

Note [one loss scale for every rank]: float16 gradients underflow unless the loss is scaled up
before backward and the gradients scaled down before the step; a step whose gradients hold an
inf or a NaN is skipped and the scale lowered (torch.amp.GradScaler's dynamic rule). With the
model split, each rank holds part of the gradients - a TP rank its shards (a vocabulary-
parallel head's rank whose rows hold the batch's targets overflows where its peer does not), a
pipeline rank its stages, a ZeRO rank its shard - so an overflow is seen by some ranks only. A
GradScaler per process then skipped the step on those ranks and stepped on the others, and the
scales went apart: replicated norm weights drifted between TP ranks, silently (review finding,
helper-48). Here the ranks agree: after the gradients are reduced, each checks and unscales its
own, and one all-reduce (max) over every rank of the job decides for all of them; the scale
then changes the same way everywhere. FSDP's ShardedGradScaler does the same over its group.

`parallelize(..., loss_scale="dynamic")` (GradScaler's defaults: 2**16, halved on an overflow,
doubled after 2000 steps without one) or a number (a static scale); the step's loss is scaled
inside forward_backward (a pipeline's last stage scales the loss it backpropagates), the
gradients are unscaled before clipping (`clip_grad_norm_`) or at `step()`, which skips the
optimizer on every rank when any rank overflowed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel_layers import fault


class LossScale:
    """A loss scale that every rank changes together (Note [one loss scale for every rank])."""

    def __init__(self, init_scale: float = 2.0 ** 16, *, dynamic: bool = True, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale, self.dynamic = float(init_scale), dynamic
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # steps since the last overflow (or growth)

    @staticmethod
    def from_argument(loss_scale) -> "LossScale | None":
        """parallelize's loss_scale=: None, "dynamic", or a static scale (a positive finite number)."""
        if loss_scale is None or isinstance(loss_scale, LossScale):
            return loss_scale
        if loss_scale == "dynamic":
            return LossScale()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and \
                math.isfinite(loss_scale) and loss_scale > 0:
            return LossScale(float(loss_scale), dynamic=False)
        raise ValueError(f"loss_scale must be None (no loss scaling: float32 or bfloat16 training), 'dynamic' "
                         f"(float16: torch.amp.GradScaler's rule, agreed by every rank), a positive finite number "
                         f"(a static scale) or a LossScale(init_scale, ...); got {loss_scale!r}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients the optimizer will step by the scale; True if any rank's held an
        inf or a NaN (then they are garbage, and the step is skipped everywhere). A collective
        over every rank."""
        by_place: dict[tuple, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_place.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        # the collective's device, not the first gradient's: under ZeRO-Offload the shard gradients
        # are on the CPU, which an NCCL process group does not take (review finding, helper-74)
        device = _default_device()
        found = torch.zeros((), dtype=torch.float32, device=device)
        for (place, _), grads in by_place.items():
            found_here = torch.zeros((), dtype=torch.float32, device=place)
            inv_scale = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=place)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale)
            found = torch.maximum(found, found_here.to(device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            with fault.collective("loss scaling's all_reduce of overflows", None):
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, overflowed: bool) -> None:
        """After a step: an overflow halves a dynamic scale; growth_interval steps without one
        double it (torch.amp.GradScaler.update's rule)."""
        if not self.dynamic:
            return
        if overflowed:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
