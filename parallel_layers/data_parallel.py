"""`DataParallel(model)`: replicated data parallelism with bucketed, overlapped all-reduce.

    model = DataParallel(model)                  # after init_parallel / init_process_group
    loss_fn(model(batch)).backward()             # grads are averaged over the group here
    optimizer.step()

Gradients are packed into buckets of about `bucket_mb` MiB (the first one `first_bucket_mb`,
so communication starts early) and the buckets' all-reduces are launched, asynchronously,
while backward still computes the rest (Note [agreed bucket order]). The end of backward
waits for them and writes the averages back. `no_sync()` accumulates locally; the next
backward outside it (or `reduce_gradients()`) reduces the sum. A parameter may go unused on
some ranks (Note [unused parameters]).
Parameters are broadcast from rank 0 at construction, so every replica starts equal.

Note [agreed bucket order]: NCCL matches collectives by the order they are issued, not by
content, so every rank must launch the same all-reduces, of the same sizes, in the same
order - whatever order its own gradients arrive in. Buckets start in reverse registration
order (a guess at the backward order); after the first reduction, rank 0's observed arrival
order is broadcast as parameter indices and every rank rebuilds the same buckets from it,
once. Bucket k is launched when all its gradients have arrived in this backward and buckets
0..k-1 have been launched; the end of backward launches the rest, in order. This rank sees
its backward through its parameters' gradient hooks, so each rank's backward must reach at
least one parameter (or the caller runs `no_sync()` backwards and `reduce_gradients()`).
The order is agreed, the moment of each launch is not: a bucket holding a parameter unused
on one rank launches at the end of that rank's backward. Other collectives on the same group
during backward (a SyncBatchNorm, say) could then fall between the buckets differently on
each rank; give them a group of their own.

Note [unused parameters]: a parameter that got no gradient on this rank since the last
reduction (data-dependent control flow) contributes zeros: the average is over all ranks,
as if that rank's gradient were zero. Each bucket's all-reduce carries, after the gradients,
one count per parameter of the ranks that used it, so every rank learns without another
collective which parameters no rank used: their `.grad` is left as it was (None after
`zero_grad()`, as PyTorch DDP does). Every other parameter's `.grad` gets the average.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import fault, placement
from parallel_layers._accumulation import LocalAccumulation

_ALL_REDUCE = "DataParallel gradient all_reduce"


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # [numel gradients | one used-count per parameter], Note [unused parameters]
        self.buffer = torch.zeros(self.numel + len(params), dtype=params[0].dtype, device=params[0].device)
        self.arrived: set[int] = set()  # ids of params whose gradient arrived in this backward
        self.work = None

    def complete(self) -> bool:
        return len(self.arrived) == len(self.params)

    def launch(self, group, world: int, used: set[int]) -> None:
        offset = 0
        for p in self.params:
            chunk = self.buffer[offset:offset + p.numel()]
            chunk.copy_(p.grad.reshape(-1)) if id(p) in used else chunk.zero_()
            offset += p.numel()
        self.all_used = all(id(p) in used for p in self.params)
        if self.all_used:  # the common case: no host-to-device copy
            self.buffer[self.numel:].fill_(1)
        else:
            self.buffer[self.numel:].copy_(torch.tensor([float(id(p) in used) for p in self.params]))
        self.buffer[:self.numel].div_(world)
        fault.check_agreement(_ALL_REDUCE, self.buffer, group)
        with fault.collective(_ALL_REDUCE, group):
            self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    def finish(self, group) -> None:
        fault.wait(self.work, _ALL_REDUCE, group)
        self.work = None
        offset = 0
        # Read the counts (a host sync on a GPU) only if this rank left a parameter unused:
        # a parameter used here has a count of at least 1.
        counts = [1.0] * len(self.params) if self.all_used else self.buffer[self.numel:].tolist()
        for p, users in zip(self.params, counts):
            if users > 0:  # used on some rank; else .grad stays as it was
                average = self.buffer[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = average.clone()
                else:
                    p.grad.copy_(average)
            offset += p.numel()
        self.arrived.clear()


def _split_into_buckets(params: list[nn.Parameter], bucket_bytes: int, first_bytes: int) -> list[_Bucket]:
    buckets, current, size = [], [], 0
    for p in params:
        limit = first_bytes if not buckets else bucket_bytes
        if current and (size + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(_Bucket(current))
    return buckets


class DataParallel(LocalAccumulation, nn.Module):
    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0):
        super().__init__()
        if not (bucket_mb > 0 and first_bucket_mb > 0):
            raise ValueError(f"bucket sizes must be positive, got bucket_mb={bucket_mb}, "
                             f"first_bucket_mb={first_bucket_mb}")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed to be initialised (init_parallel or "
                               "init_process_group)")
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._bucket_bytes, self._first_bytes = int(bucket_mb * 2**20), int(first_bucket_mb * 2**20)
        # One rank's experts (expert_parallel.py) are not replicas: neither broadcast nor averaged.
        replicated = [p for p in module.parameters() if placement.expert_group(p) is None]
        self._params = [p for p in replicated if p.requires_grad]
        with torch.no_grad():
            # A model built on the meta device has no values to broadcast yet; its loader
            # (hf.load_pretrained) writes the same values on every replica.
            for p in (p for p in replicated if not p.is_meta):
                fault.check_agreement("DataParallel parameter broadcast", p, group)
                with fault.collective("DataParallel parameter broadcast", group):
                    dist.broadcast(p, src=self._src, group=group)
        self._set_buckets(list(reversed(self._params)))
        self._arrival: list[nn.Parameter] | None = []  # gradient order until the first reduction
        self._seen: set[int] = set()  # params with a gradient since the last reduction
        self._launched = 0  # buckets launched in this reduction, Note [agreed bucket order]
        self._callback_queued = False
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _set_buckets(self, ordered: list[nn.Parameter]) -> None:
        self.buckets = _split_into_buckets(ordered, self._bucket_bytes, self._first_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def materialize(self, device: torch.device | str) -> None:
        """A module built on the meta device gets zero-filled storage on `device`, in place
        (parallel_layers/meta.py), and the gradient buckets are rebuilt there. Write the same
        values on every replica (e.g. `hf.load_pretrained`) before training."""
        from parallel_layers.meta import materialize_module

        materialize_module(self.module, device)
        self._set_buckets([p for b in self.buckets for p in b.params])

    def state_placement(self, prefix: str = "") -> placement.ModelPlacement:
        """Every rank holds the whole module (parallel_layers.placement)."""
        return placement.describe(self.module, prefix)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._seen.add(id(p))
        if self._arrival is not None:
            self._arrival.append(p)
        if not self._sync:
            return
        self._bucket_of[id(p)].arrived.add(id(p))
        while self._launched < len(self.buckets) and self.buckets[self._launched].complete():
            self.buckets[self._launched].launch(self.group, self.world, self._seen)
            self._launched += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            self._reduce()

    def reduce_gradients(self) -> None:
        """All-reduce now the gradients accumulated under `no_sync()`: for a caller that runs
        several backwards per step and knows when the last one is done (PipelineParallel)."""
        self._reduce()

    def _reduce(self) -> None:
        for b in self.buckets[self._launched:]:  # incomplete buckets, or all after no_sync()
            b.launch(self.group, self.world, self._seen)
        for b in self.buckets:
            b.finish(self.group)
        self._launched = 0
        self._seen.clear()
        if self._arrival is not None:
            self._agree_on_order()

    def _agree_on_order(self) -> None:
        """Rebuild the buckets, once, in rank 0's gradient arrival order (Note [agreed bucket order])."""
        index = {id(p): i for i, p in enumerate(self._params)}
        arrived = [index[id(p)] for p in dict.fromkeys(self._arrival)]
        self._arrival = None
        if not self._params:
            return
        never = sorted(set(range(len(self._params))) - set(arrived), reverse=True)
        order = torch.tensor(arrived + never, device=self._params[0].device)
        fault.check_agreement("DataParallel bucket order broadcast", order, self.group)
        with fault.collective("DataParallel bucket order broadcast", self.group):
            dist.broadcast(order, src=self._src, group=self.group)
        self._set_buckets([self._params[i] for i in order.tolist()])
