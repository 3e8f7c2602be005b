"""`DataParallel(model)`: replicated data parallelism with bucketed, overlapped all-reduce.

    model = DataParallel(model)                  # after init_parallel / init_process_group
    loss_fn(model(batch)).backward()             # grads are averaged over the group here
    optimizer.step()

Gradients are packed into buckets of about `bucket_mb` MiB (the first one `first_bucket_mb`,
so communication starts early) and each bucket's all-reduce is launched, asynchronously, as
soon as its last gradient is accumulated - while backward still computes the rest. The end
of backward waits for them and writes the averages back. Buckets start in reverse parameter
order (a guess at the backward order) and are rebuilt once, after the first backward, in
the order gradients actually arrived. `no_sync()` accumulates locally; the next backward
outside it (or `reduce_gradients()`) reduces the sum. A parameter that got no gradient since
the last reduction (unused in forward) is an error naming it, since the other ranks would
otherwise wait for it forever.
Parameters are broadcast from rank 0 at construction, so every replica starts equal.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import fault
from parallel_layers._accumulation import LocalAccumulation


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.ready = 0
        self.work = None

    def launch(self, group, world: int) -> None:
        offset = 0
        for p in self.params:
            self.buffer[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        self.buffer.div_(world)
        fault.check_agreement("DataParallel gradient all_reduce", self.buffer, group)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    def finish(self, group) -> None:
        fault.wait(self.work, "DataParallel gradient all_reduce", group)
        self.work = None
        offset = 0
        for p in self.params:
            p.grad.copy_(self.buffer[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        self.ready = 0


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
        self._bucket_bytes, self._first_bytes = int(bucket_mb * 2**20), int(first_bucket_mb * 2**20)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters()}
        with torch.no_grad():
            for p in module.parameters():
                fault.check_agreement("DataParallel parameter broadcast", p, group)
                with fault.collective("DataParallel parameter broadcast", group):
                    dist.broadcast(p, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self._set_buckets(list(reversed(self._params)))
        self._arrival: list[nn.Parameter] | None = []  # observed gradient order, first backward only
        self._seen: set[int] = set()
        self._callback_queued = False
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _set_buckets(self, ordered: list[nn.Parameter]) -> None:
        self.buckets = _split_into_buckets(ordered, self._bucket_bytes, self._first_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

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
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.launch(self.group, self.world)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            self._reduce()

    def reduce_gradients(self) -> None:
        """All-reduce now the gradients accumulated under `no_sync()`: for a caller that runs
        several backwards per step and knows when the last one is done (PipelineParallel)."""
        self._reduce()

    def _reduce(self) -> None:
        # Parameters used only in some of the backwards since the last reduction are fine;
        # one never used would leave the other ranks waiting for its bucket.
        missing = [self._names[id(p)] for p in self._params if id(p) not in self._seen]
        self._seen.clear()
        if missing:
            for b in self.buckets:  # do not leave collectives half-issued
                if b.work is not None:
                    fault.wait(b.work, "DataParallel gradient all_reduce", self.group)
                    b.work = None
                b.ready = 0
            raise RuntimeError(
                f"DataParallel: parameters {missing} received no gradient since the last reduction (not used in "
                "forward?). Every rank must reduce every parameter; use them, set requires_grad=False on them, or "
                "remove them.")
        for b in self.buckets:
            if b.work is None:  # some of its gradients came from backwards under no_sync()
                b.launch(self.group, self.world)
        for b in self.buckets:
            b.finish(self.group)
        if self._arrival is not None:
            # Rebuild once, in the order gradients arrived, so buckets fill as backward runs.
            order = list(dict.fromkeys(self._arrival))
            self._arrival = None
            self._set_buckets(order)
