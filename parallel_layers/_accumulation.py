"""`no_sync()` for the data-parallel wrappers (DataParallel, ZeRO): one definition; and the
divisor of a summed loss over data-parallel replicas (`token_divisor`)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_layers import fault


class LocalAccumulation:
    """Mixin: while `no_sync()` is active, `self._sync` is False and the wrapper keeps
    gradients local; the next backward outside it reduces the accumulated sum."""

    _sync = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True


# Note [token mean over data parallelism]: with `token_count`, `loss_fn` returns a sum over this
# replica's counted items (labelled tokens) and the step divides it by a count. Divided by the
# replica's own count, the data-parallel wrappers' gradient average is the mean of the replicas'
# means, which is not the batch's token mean when replicas hold different numbers of labelled
# tokens (padded batches). Measured by a review at dp=2 on a padded Llama batch: a loss 1.6e-3
# from Hugging Face's whole-batch loss, parameters 1e-1 apart after one SGD step. So the counts
# are summed over the dp group (one all-reduce of a scalar a step) and each replica divides by
# total / dp: the wrappers then average the gradients over the dp replicas, which gives the
# gradient of (sum of every replica's sum) / total, the loss of the whole batch as transformers
# computes it (its Trainer does the same with average_tokens_across_devices). The loss a replica
# returns is its sum * dp / total; the mean over the replicas is the batch's token mean.
def token_divisor(count, group, device) -> Tensor:
    """total / dp of `count` over the data-parallel `group` (Note [token mean over data
    parallelism]); `group` None: no data parallelism, the count itself. A collective over
    `group`: every replica calls it once a step."""
    total = torch.as_tensor(count, device=device).detach().to(torch.float64).reshape(()).clone()
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return total
    with fault.collective("token count all-reduce over dp", group):
        dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)
