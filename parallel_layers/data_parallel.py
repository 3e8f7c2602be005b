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
Parameters and buffers (a BatchNorm's running statistics, a random projection) are broadcast
from rank 0 at construction, so every replica starts equal; afterwards each replica updates
its buffers itself (torch DDP's broadcast_buffers=False; SyncBatchNorm shares statistics). One
rank's experts under expert parallelism are replicas over their replica group only: broadcast
and averaged over it, in buckets of their own (Note [expert replicas] in expert_parallel.py).

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
as if that rank's gradient were zero - or, when an earlier backward of the same step left it a
gradient (the average of that reduction, equal on every rank), that gradient, so that a second
backward before the step adds its average to the first's as the single process would. Each bucket's all-reduce carries, after the gradients,
one count per parameter of the ranks that used it, so every rank learns without another
collective which parameters no rank used: their `.grad` is left as it was (None after
`zero_grad()`, as PyTorch DDP does). Every other parameter's `.grad` gets the average.
"""

from __future__ import annotations

import functools

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
        # a gradient set to None since (zero_grad after a no_sync() backward) is not a use
        used = {id(p) for p in self.params if id(p) in used and p.grad is not None}
        offset = 0
        for p in self.params:
            chunk = self.buffer[offset:offset + p.numel()]
            # Unused here since the last reduction: that reduction's average if it left one (the
            # same on every rank, so a second backward before the step keeps it whole), else zeros.
            chunk.copy_(p.grad.reshape(-1)) if p.grad is not None else chunk.zero_()
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


class _Reducer:
    """One process group's share of the gradients: its parameters' buckets, launched in the
    agreed order (Note [agreed bucket order]) and averaged over `group`; during backward as
    they fill when `overlap`, else all at the end of backward."""

    def __init__(self, params: list[nn.Parameter], group, bucket_bytes: int, first_bytes: int,
                 overlap: bool = True):
        self.params, self.group, self.overlap = params, group, overlap
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self._bucket_bytes, self._first_bytes = bucket_bytes, first_bytes
        self.set_buckets(list(reversed(params)))
        self.arrival: list[nn.Parameter] | None = []  # gradient order until the first reduction
        self.seen: set[int] = set()  # params with a gradient since the last reduction
        self.launched = 0  # buckets launched in this reduction

    def set_buckets(self, ordered: list[nn.Parameter]) -> None:
        self.buckets = _split_into_buckets(ordered, self._bucket_bytes, self._first_bytes)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def broadcast(self, params: list[nn.Parameter]) -> None:
        """Every replica starts from the values of the group's first rank. A module built on the
        meta device has no values yet; its loader (hf.load_pretrained) writes the same values on
        every replica."""
        with torch.no_grad():
            for p in (p for p in params if not p.is_meta):
                fault.check_agreement("DataParallel parameter broadcast", p, self.group)
                with fault.collective("DataParallel parameter broadcast", self.group):
                    dist.broadcast(p, src=self.src, group=self.group)

    def on_grad(self, p: nn.Parameter, sync: bool) -> None:
        self.seen.add(id(p))
        if self.arrival is not None:
            self.arrival.append(p)
        if not (sync and self.overlap):
            return
        self.bucket_of[id(p)].arrived.add(id(p))
        while self.launched < len(self.buckets) and self.buckets[self.launched].complete():
            self.buckets[self.launched].launch(self.group, self.world, self.seen)
            self.launched += 1

    def forget_backward(self) -> None:
        """A backward that raised never reached its end (Note [a backward that raised]): wait for
        the buckets it launched and start the next reduction afresh."""
        for b in self.buckets:
            if b.work is not None:
                fault.wait(b.work, _ALL_REDUCE, self.group)
                b.work = None
            b.arrived.clear()
        self.launched = 0
        self.seen.clear()

    def reduce(self) -> None:
        for b in self.buckets[self.launched:]:  # incomplete buckets, or all after no_sync()
            b.launch(self.group, self.world, self.seen)
        for b in self.buckets:
            b.finish(self.group)
        self.launched = 0
        self.seen.clear()
        if self.arrival is not None:
            self._agree_on_order()

    def _agree_on_order(self) -> None:
        """Rebuild the buckets, once, in the first rank's gradient arrival order (Note [agreed bucket order])."""
        index = {id(p): i for i, p in enumerate(self.params)}
        arrived = [index[id(p)] for p in dict.fromkeys(self.arrival)]
        self.arrival = None
        if not self.params:
            return
        never = sorted(set(range(len(self.params))) - set(arrived), reverse=True)
        order = torch.tensor(arrived + never, device=self.params[0].device)
        fault.check_agreement("DataParallel bucket order broadcast", order, self.group)
        with fault.collective("DataParallel bucket order broadcast", self.group):
            dist.broadcast(order, src=self.src, group=self.group)
        self.set_buckets([self.params[i] for i in order.tolist()])


def _refuse_unfrozen(name: str, p: nn.Parameter) -> None:
    """A parameter frozen when DataParallel was built is in no bucket: unfrozen later, its
    gradient would stay this replica's own and the replicas would drift apart with no error
    (review finding; torch's DDP has the same limit, documented)."""
    raise RuntimeError(
        f"DataParallel: {name} got a gradient, but it was frozen (requires_grad=False) when DataParallel was built, "
        "so no gradient bucket holds it: its gradient would not be averaged over the data-parallel ranks and the "
        "replicas would drift apart. Set requires_grad on the parameters that will train before parallelize / "
        "DataParallel (or build it again after changing them); zero_stage 1-3 shard frozen parameters too and take "
        "this change")


def release_frozen_hooks(module: nn.Module) -> None:
    """Remove the hooks an earlier DataParallel left on `module`'s parameters - its refusals on
    the frozen ones, its reduction on the others (two wrappers each all-reduced every gradient,
    and an old one over another group averaged over the wrong ranks: review finding): a new
    wrapper (DataParallel again, or ZeRO, which takes a parameter unfrozen later) decides."""
    for p in module.parameters():
        for name in ("_pl_frozen_hook", "_pl_dp_hook"):
            hook = p.__dict__.pop(name, None)
            if hook is not None:
                hook.remove()


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
        sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True
                  and any(p.requires_grad for p in m.parameters(recurse=False))]
        if sparse:  # the buckets are dense: it failed in backward, "reshape is not implemented for sparse tensors"
            raise ValueError(f"DataParallel averages dense gradients; {sparse[:3]} make sparse ones (sparse=True): "
                             "build them with sparse=False (the default), or use ZeRO")
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        sizes = int(bucket_mb * 2**20), int(first_bucket_mb * 2**20)
        # A rank's experts under expert parallelism (expert_parallel.py) are other experts on
        # each rank of their expert-parallel group: replicas only over their replica group (the
        # dp ranks with the same expert-parallel rank), where they are broadcast and averaged
        # as the rest are over dp - Note [expert replicas] there. With ep = dp they have none.
        # Their buckets are all-reduced at the end of backward, not as they fill: when they fill
        # depends on the routing (an expert no token reached gets its zero gradient at another
        # point of the backward), and with the all-to-alls of other groups in between, ranks
        # could wait on each other in a cycle (Note [expert groups] in zero/_hooks.py).
        by_group: dict[object, list[nn.Parameter]] = {None: []}
        for p in module.parameters():
            key = placement.expert_replica_group(p) if placement.expert_group(p) is not None else None
            by_group.setdefault(key, []).append(p)
        self._reducers: list[_Reducer] = []
        for key, params in by_group.items():
            reduce_over = group if key is None else key
            if key is not None and dist.get_world_size(reduce_over) == 1:
                continue
            reducer = _Reducer([p for p in params if p.requires_grad], reduce_over, *sizes, overlap=key is None)
            reducer.broadcast(params)
            self._reducers.append(reducer)
        # the buffers of modules without experts (an expert module's differ by expert-parallel rank)
        self._reducers[0].broadcast([b for m in module.modules() if not any(
            placement.expert_group(p) is not None for p in m.parameters(recurse=False))
            for b in m.buffers(recurse=False) if b.is_floating_point() or b.is_complex()])
        self._reducer_of = {id(p): r for r in self._reducers for p in r.params}
        self._callback_queued = False
        release_frozen_hooks(module)  # an earlier DataParallel's (built again after unfreezing): this one decides
        for r in self._reducers:
            for p in r.params:
                p._pl_dp_hook = p.register_post_accumulate_grad_hook(self._on_grad)
        for name, p in module.named_parameters():
            if not p.requires_grad and (p.is_floating_point() or p.is_complex()):  # others cannot require grad
                # registered while it requires grad, the hook stays for when it is unfrozen
                p.requires_grad_(True)
                p._pl_frozen_hook = p.register_post_accumulate_grad_hook(functools.partial(_refuse_unfrozen, name))
                p.requires_grad_(False)

    @property
    def buckets(self) -> list[_Bucket]:
        """Every gradient bucket, the data-parallel group's first (Note [agreed bucket order])."""
        return [b for r in self._reducers for b in r.buckets]

    def materialize(self, device: torch.device | str) -> None:
        """A module built on the meta device gets zero-filled storage on `device`, in place
        (parallel_layers/meta.py), and the gradient buckets are rebuilt there. Write the same
        values on every replica (e.g. `hf.load_pretrained`) before training."""
        from parallel_layers.meta import materialize_module

        materialize_module(self.module, device)
        for r in self._reducers:
            r.set_buckets([p for b in r.buckets for p in b.params])

    def state_placement(self, prefix: str = "") -> placement.ModelPlacement:
        """Every rank holds the whole module (parallel_layers.placement)."""
        return placement.describe(self.module, prefix)

    def forward(self, *args, **kwargs):
        if self._callback_queued and torch._C._current_graph_task_id() == -1:  # Note [a backward that raised]
            self._callback_queued = False
            for r in self._reducers:
                r.forget_backward()
        return self.module(*args, **kwargs)

    # Note [a backward that raised]: the first gradient of a backward queues the reduction at its
    # end; a backward that raises (out of memory, a refusal such as row 78d) never gets there,
    # and autograd drops the callback. The flag saying one was queued stayed set, so no later
    # backward queued another: every following step trained on each replica's own gradient,
    # silently (review finding: 0.5-0.9 relative from the average). The next forward sees the
    # flag, waits for the buckets the failed backward launched (every rank launched them alike
    # when every rank raised) and starts afresh; the gradients it left are the caller's to zero.
    # Not inside a running backward (the flag is set there too): a checkpointed wrapper's
    # recompute calls this forward mid-backward, and resetting then left the gradients that had
    # arrived unaveraged (review finding).
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._reducer_of[id(p)].on_grad(p, self._sync)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """All-reduce now the gradients accumulated under `no_sync()`: for a caller that runs
        several backwards per step and knows when the last one is done (PipelineParallel)."""
        for r in self._reducers:
            r.reduce()
