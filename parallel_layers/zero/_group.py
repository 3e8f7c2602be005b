"""`ParamGroup`: the ShardedParams of one wrapped module, gathered and reduced together.

One all-gather fills every full parameter of a group from the members' shards, one
reduce-scatter turns their full gradients into shard gradients (Note [ZeRO sharded
parameter] in _param.py for the per-parameter layout). Buffers are [W, S]: W ranks, S = the
sum of the members' shard sizes, rank-major (parallel_layers/ops/shard_copy.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import fault
from parallel_layers.ops import shard_copy

if TYPE_CHECKING:
    from parallel_layers.zero._param import ShardedParam


# Note [ZeRO streams]: on CUDA every group's copy-in and all-gather run on one side stream
# per device, so a prefetch overlaps the compute stream's current layer. Each launch first
# makes the side stream wait for everything the compute stream has queued (the optimizer's
# shard updates, earlier copy-outs); `unshard` then makes the compute stream wait for the side
# stream (work.wait() does that through NCCL's stream, but a world of one has no collective)
# and copies out there. The gather buffer is allocated on the side
# stream and last used by a copy-out on the compute stream; no record_stream is needed:
# when Python frees it, the allocator may give the block to the side stream again, and all
# side-stream work is queued after a wait on the compute stream, so after that copy-out.
_SIDE_STREAMS: dict = {}

# Note [gloo reduce-scatter]: gloo's reduce_scatter_tensor clones its whole input, all-reduces
# the clone and copies this rank's slot out (two copies of the [W, S] buffer, measured as ~4% of
# a Llama ZeRO-3 step on 2 CPU ranks). An in-place all-reduce of the buffer (what ZeRO did next)
# avoids the copies but moves twice a reduce-scatter's bytes: every rank gets every slot's sum
# and reads one (ZeRO-3 sent ~112 MB a step a rank on the benchmarks' Llama where 82 MB are
# needed; helper-68). So on gloo ZeRO sends row r of its [W, S] buffer to rank r and receives
# every other rank's copy of its own row into a [W - 1, S] buffer (point to point, all posted at
# once, on a tag of its own, as Note [gloo all-gather] does), and `finish_reduce` adds them to its
# row: a reduce-scatter's bytes, no extra copy, the receive buffer from the pool. NCCL's
# reduce-scatter is used there.


def _all_gather_stream(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    stream.wait_stream(torch.cuda.current_stream(index))
    return torch.cuda.stream(stream)


# Note [gloo all-gather]: gloo's all_gather_into_tensor allocates a flat output of its own,
# gathers into it and copies each rank's slice out (and wants an input apart from the output):
# on a Llama ZeRO-3 step at hidden 1024 on 2 CPU ranks those copies, mostly first-touch page
# faults of the fresh allocation, took ~8% of the step. On gloo ZeRO instead sends its row of
# the [W, S] buffer to every other rank and receives theirs straight into their rows (W - 1
# sends and receives each, all posted at once, so nothing waits on an order): the bytes an
# all-gather moves, without a copy. Every rank issues a group's gathers in the same agreed
# order (Note [agreed reduction order] in _hooks.py) and gloo delivers one pair's messages on
# one tag in order, so two gathers in flight cannot mix. Gloo keeps point-to-point slots
# apart from its collectives'. NCCL's all-gather is in place and uses no extra copy.
_GATHER_TAG = 0x2E60
_REDUCE_TAG = 0x2E61  # Note [gloo reduce-scatter]: apart from the gathers'

# Whether ZeRO on gloo takes the copy-free paths of Note [gloo all-gather] and Note [gloo
# reduce-scatter] (True), or issues the collectives NCCL runs, all_gather_single and
# reduce_scatter_single (False): the tests of collective order (tests/test_agreed_collectives.py)
# set it False in their workers, so that NCCL's calls and their order are exercised on the CPU.
GLOO_DIRECT = True

# Note [gloo direct members]: a member's shard is a contiguous slice of its flattened full
# parameter (Note [ZeRO sharded parameter] in _param.py), and of its flattened full gradient:
# rank q's is elements [q * s, q * s + s) of it, padding cut off. So on gloo's point-to-point
# path the [W, S] buffer is not needed for a large member: its all-gather receives every peer's
# shard straight into that peer's slice of the refilled full parameter (and copies its own shard
# into its own slice), and its reduce-scatter sends each peer that peer's slice of the full
# gradient and adds what it receives into its own slice's average. What that saves a step: the
# all-gather's copy-out of every full parameter and the reduce-scatter's copy-in of every full
# gradient, ~60 ms of ~1.1 s (profiled, 4 ZeRO-3 steps of bench_hf's Llama at hidden 512, fp32,
# on this project's 2-core CPU), for one message per peer and member instead of one per unit.
# Members under GLOO_DIRECT_MIN_BYTES (norm weights, biases, small projections) stay in the
# buffer, where many share one message. Which members go direct depends only on their shapes,
# dtypes and layout, the same on every rank, and every rank posts a unit's messages in the same
# order (the buffer's first, then the members' in order), which gloo matches pair by pair.
# Only where the full parameters are freed between uses (ZeRO-3's units): there the gather
# writes into storage nobody reads until `unshard` returns; a kept full parameter (ZeRO-1/2,
# the root) takes the buffer. NCCL keeps its collectives, which copy nothing anyway.
# PARALLEL_LAYERS_GLOO_DIRECT_MIN_BYTES sets it (0: every member of a ZeRO-3 unit; the tests'
# models are far smaller than the default).
GLOO_DIRECT_MIN_BYTES = int(os.environ.get("PARALLEL_LAYERS_GLOO_DIRECT_MIN_BYTES", 1 << 20))


def _real(numel: int, shard: int, rank: int) -> int:
    """Elements of rank `rank`'s shard that are the parameter's, not padding."""
    return max(0, min(shard, numel - rank * shard))


# Note [CPU parameter storage reuse]: ZeRO-3 frees a full parameter by resizing its storage to
# zero and refills it for the next use (Note [ZeRO sharded parameter] in _param.py). On the CPU
# that is a free and a fresh allocation each time, and glibc serves allocations over its mmap
# threshold (at most 32 MB) with new pages, which the all-gather's copy-out then faults in one
# by one: a 45 MB Mixtral expert weight took 23-27 ms to copy into fresh memory against 5 ms
# into memory already touched, on this project's 2-core CPU (~240 ms of copies a ZeRO-3 step at
# hidden 512, 1.5 s in all; DDP, whose parameters stay, pays none of it). So the repeated
# blocks' groups (the ones sharing a BufferPool) hand such a freed storage's memory to the pool
# instead (`_swap_data_ptr_`: the storage object stays - autograd's saved references and the
# views of it are untouched - and is left with no bytes, exactly as resize_(0) leaves it), and
# the next refill of the same size takes it back. The pool keeps at most two units' worth of
# each size (`expect_units`): in a forward, the unit just used gives its memory to the one
# prefetched next, and at the end of a backward the first two units' memory waits for the next
# forward's first two gathers, which take it back - while a freed unit's memory was returned
# to the system before, so up to two units' full parameters stay allocated between those
# points. CUDA's caching allocator already does this on a GPU, where none of it applies. Torch
# builds without `_swap_data_ptr_` free and allocate as before.
# Only storages glibc would map afresh are kept: those of at least its mmap threshold, which
# starts at 128 KiB and rises with what is freed up to 32 MiB, where it stops (on 64-bit), or
# MALLOC_MMAP_THRESHOLD_ where that fixes it (`plan --verify` sets 64 KiB). Smaller ones come
# back from glibc's heap already touched, and keeping them here instead took that memory from
# the activations and gradients allocated meanwhile: the Llama of bench_hf (tensors of 1-6 MB)
# measured 1.147 -> 1.114 of DDP's step with them left to glibc (3 process pairs each way), the
# Mixtral 1.27 either way (1.38 without the pool).
SWAPS_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
POOL_MIN_BYTES = int(os.environ.get("MALLOC_MMAP_THRESHOLD_", 32 * 2**20))


class _Works:
    """The work handles of one gloo all-gather's sends and receives, waited on as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class BufferPool:
    """Note [CPU buffer reuse]: the [W, S] gather and reduce buffers of a ZeRO-3 wrapper's
    repeated blocks, kept for the next group of the same size instead of freed. On the CPU a
    buffer of tens of MB is a fresh mmap each time, and first touching its pages (the
    copy-in) costs more than the copy: ~5% of a Llama ZeRO-3 step at hidden 1024 on 2 CPU
    ranks. The decoder layers' groups are all one size, so a few buffers serve every layer:
    at most `keep` per size are kept during a backward, as many as are in use at once there
    (two gathers and two reductions in flight, each reduction with its gloo receive buffer of
    [W - 1, S]: Note [gloo reduce-scatter]). At the end of backward (`trim`) the pool keeps
    only the two gather buffers the next forward needs (the gathered group and the prefetched
    one): the reduce buffers would otherwise sit idle through the next forward and its
    activations' peak, which the planner does not count (measured: 35 MB over the prediction
    on a Llama at hidden 512). Only stage 3's wrapped groups of a size at least three groups
    share use it (the repeated blocks: ZeRO's `_pooled`): the root, ZeRO-1/2 and the
    vocabulary units gather and reduce once or twice a step, where a kept buffer would be
    memory held idle for a whole step to save a fault or two. CUDA's caching allocator already
    reuses device memory: there, buffers are plain torch.empty.

    The full parameters' own storage is kept the same way (Note [CPU parameter storage reuse])."""

    def __init__(self, keep: int = 4, keep_between_steps: int = 2):
        self.keep, self.keep_between_steps = keep, keep_between_steps
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._gather_keys: set[tuple] = set()  # the sizes and dtypes the gathers take
        self.allocated = 0  # buffers made so far (the rest of the requests were served from _free)
        # Note [CPU parameter storage reuse]: memory of freed full parameters, by byte size
        self._blocks: dict[int, list[torch.UntypedStorage]] = {}  # CPU memory only
        # byte size -> at most this many kept (`expect_units`); by size alone: a model built on the
        # meta device gets its CPU storage after the pool was told its sizes (review finding)
        self.keep_blocks: dict[int, int] = {}
        self.refills_reused = self.refills_new = 0  # refills served from kept memory, and allocated anew

    @staticmethod
    def _key(shape, dtype: torch.dtype, device) -> tuple:
        return tuple(shape), dtype, torch.device(device) if device is not None else None

    def empty(self, shape, *, dtype: torch.dtype, device, gather: bool = False) -> torch.Tensor:
        key = self._key(shape, dtype, device)
        if gather:
            self._gather_keys.add(key)
        free = self._free.get(key)
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, t: torch.Tensor) -> None:
        free = self._free.setdefault(self._key(t.shape, t.dtype, t.device), [])
        if t.device.type == "cpu" and len(free) < self.keep:
            free.append(t)

    def trim(self) -> None:
        """End of backward: keep `keep_between_steps` buffers of each gather size, none else."""
        for key, free in self._free.items():
            del free[self.keep_between_steps if key in self._gather_keys else 0:]

    @property
    def idle_bytes(self) -> int:
        """Bytes of the [W, S] buffers kept (not the parameter storage: `idle_storage_bytes`)."""
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    # ---- the full parameters' storage (Note [CPU parameter storage reuse]) ----------------------
    def expect_units(self, units: list[list[ShardedParam]]) -> None:
        """Keep up to two units' worth of each storage size: the full parameters' storages of
        `units` (the pooled groups' members), each counted once however many members share it."""
        for members in units:
            count: dict[int, int] = {}
            for nbytes in {sp.full.untyped_storage()._cdata: sp._storage_nbytes for sp in members}.values():
                count[nbytes] = count.get(nbytes, 0) + 1
            for nbytes, c in count.items():
                self.keep_blocks[nbytes] = max(self.keep_blocks.get(nbytes, 0), 2 * c)

    def free_storage(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory away (it is left with none, as resize_(0) leaves it), kept
        for the next refill of its size while fewer than `keep_blocks` of that size are."""
        blocks = self._blocks.setdefault(storage.nbytes(), [])
        if SWAPS_STORAGE and storage.device.type == "cpu" and storage.nbytes() >= POOL_MIN_BYTES and \
                len(blocks) < self.keep_blocks.get(storage.nbytes(), 0):
            block = torch.UntypedStorage(0)
            storage._swap_data_ptr_(block)  # storage: no bytes; block: its memory
            blocks.append(block)
        else:
            storage.resize_(0)

    def refill_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give `storage` (freed) `nbytes` of memory: kept memory of that size if there is any."""
        blocks = self._blocks.get(nbytes) if storage.device.type == "cpu" else None
        if blocks:
            storage._swap_data_ptr_(blocks.pop())
            self.refills_reused += 1
        else:
            storage.resize_(nbytes)
            self.refills_new += 1

    @property
    def idle_storage_bytes(self) -> int:
        return sum(b.nbytes() for blocks in self._blocks.values() for b in blocks)


def _settings(sp: ShardedParam) -> tuple:
    """What the members of one group share."""
    return sp.group, sp.param_dtype, sp.reduce_dtype, sp.offload, sp.keep_full


class ParamGroup:
    """`members` share one process group, param and reduce dtypes, offload and keep_full
    setting (ZeRO builds them alike); the group takes those from them."""

    def __init__(self, name: str, members: list[ShardedParam], pool: BufferPool | None = None):
        first = members[0]
        differ = [i for i, sp in enumerate(members) if _settings(sp) != _settings(first)]
        if differ:
            raise ValueError(f"ParamGroup {name!r}: members {differ} differ from member 0 in (process group, "
                             f"param_dtype, reduce_dtype, offload, keep_full): "
                             f"{[_settings(members[i]) for i in differ]} vs {_settings(first)}")
        self.name, self.members = name, members
        self.group, self.world, self.rank = first.group, first.world, first.rank
        self.param_dtype, self.reduce_dtype = first.param_dtype, first.reduce_dtype
        self.offload = first.offload  # ZeRO-Offload: shards, their grads and the optimizer on the CPU
        self.keep_full = first.keep_full  # False: the full parameters are freed between uses (ZeRO-3)
        self._inflight = None  # [(buffer, work handle, members)] of the all-gathers started by prefetch
        # (output, work handle, input, gloo receive buffer, members) of a reduce-scatter not yet finished
        self._reducing = None
        self._gloo = dist.get_backend(self.group) == "gloo"
        self._direct = self._gloo and GLOO_DIRECT
        self.pool = pool  # Note [CPU buffer reuse]; None: every buffer is new
        self.gather_for_backward = True  # Note [backward without parameters] in _hooks.py
        self.promoted: list[ShardedParam] = []  # members whose shard became a float32 master since the last step

    # The members' full parameters and master shards, in order (the optimizer, hooks, tests).
    @property
    def params(self) -> list[nn.Parameter]:
        return [sp.full for sp in self.members]

    @property
    def shards(self) -> list[nn.Parameter]:
        return [sp.shard for sp in self.members]

    @property
    def is_unsharded(self) -> bool:
        return all(sp.is_unsharded for sp in self.members)

    def _empty(self, device: torch.device, gather: bool = False):
        """Where a [W, S] buffer comes from: the pool on the CPU (Note [CPU buffer reuse])."""
        if self.pool is None or device.type != "cpu":
            return None
        return functools.partial(self.pool.empty, gather=gather)

    def _give_back(self, buf: torch.Tensor) -> None:
        if self.pool is not None:
            self.pool.give_back(buf)

    # ---- parameters ---------------------------------------------------------------------
    def start_unshard(self) -> None:
        """Launch the all-gather of this group's members whose full parameters are not current
        (all of them, but after `refresh_stepped`) without waiting (prefetch); no-op if none."""
        if self.is_unsharded or self._inflight is not None:
            return
        stale = [sp for sp in self.members if not sp.is_unsharded]
        # Note [mixed dtypes in a group]: one all-gather per dtype the members are gathered in (their
        # own, or param_dtype), in the members' order - the same on every rank. A unit of several
        # dtypes is common: a LoRA layer of a bfloat16 model holds float32 adapters (peft's
        # autocast_adapter_dtype) beside its bfloat16 base weight, transformers keeps xIELU's alpha
        # scalars in bfloat16 in a float32 Apertus and a router's bias in float32 in a bfloat16
        # DeepSeek-V3. One gather in the widest dtype, as a first version did, moved a LoRA unit's
        # whole base in float32 (twice its bytes) and cast it back through a float32 temporary; in
        # the first member's dtype (the version before) it rounded float32 weights to bfloat16
        # (review finding). Gradients are reduced in the widest (reduce_grads).
        kinds: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in stale:
            kinds.setdefault(self.param_dtype or sp.full.dtype, []).append(sp)
        device = self.members[0].full.device
        inflight = []
        with _all_gather_stream(device):
            for dtype, members in kinds.items():
                direct = [sp for sp in members if self._gathers_direct(sp, dtype)]  # Note [gloo direct members]
                members = [sp for sp in members if not any(sp is d for d in direct)]
                if members:
                    shards = [sp.gather_input(device) for sp in members]
                    if len({t.dtype for t in shards}) > 1:  # frozen shards beside float32 masters (Note [frozen shards keep their dtype])
                        shards = [t if t.dtype == dtype else t.to(dtype) for t in shards]
                    buf = shard_copy.all_gather_copy_in(shards, self.world, self.rank, dtype,
                                                        empty=self._empty(device, gather=True))
                    inflight.append((buf, self._launch_all_gather(buf), members))
                if direct:
                    inflight.append((None, self._launch_direct_gather(direct, dtype, device), direct))
        self._inflight = inflight

    def _gathers_direct(self, sp: ShardedParam, dtype: torch.dtype) -> bool:
        """Whether `sp` is gathered straight into its full parameter (Note [gloo direct members])."""
        full = sp.full
        return (self._direct and not self.keep_full and self.world > 1 and full.device.type == "cpu"
                and full.dtype == dtype and full.is_contiguous()
                and full.numel() * full.element_size() >= GLOO_DIRECT_MIN_BYTES)

    def _launch_direct_gather(self, members: list[ShardedParam], dtype: torch.dtype, device: torch.device) -> _Works:
        """Refill `members`' full parameters, copy this rank's shards into their slices and start
        receiving every peer's into theirs (Note [gloo direct members])."""
        ops = []
        for sp in members:
            flat = sp.refill_full(self.pool).view(-1)
            n, s = flat.numel(), sp.shard_numel
            mine = flat[self.rank * s:self.rank * s + _real(n, s, self.rank)]
            mine.copy_(sp.gather_input(device)[:mine.numel()])
            for peer in range(self.world):
                theirs = flat[peer * s:peer * s + _real(n, s, peer)]
                if peer == self.rank:
                    continue
                if mine.numel():
                    ops.append(dist.P2POp(dist.isend, mine, group=self.group, group_peer=peer, tag=_GATHER_TAG))
                if theirs.numel():
                    ops.append(dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=peer, tag=_GATHER_TAG))
        name = f"ZeRO all_gather of {self.name} (direct)"
        fault.check_agreement(name, torch.empty(sum(sp.full.numel() for sp in members), dtype=dtype,
                                                device="meta"), self.group)
        with fault.collective(name, self.group):
            return _Works(dist.batch_isend_irecv(ops) if ops else [])

    def _launch_all_gather(self, buf: torch.Tensor):
        """Start the all-gather of `buf` ([world, S], this rank's row filled); its work handle."""
        if self.world == 1:
            return None
        # gloo's point-to-point calls hand the transport the tensor's pointer as it is: host memory
        # only; gloo's collectives stage a CUDA tensor through the host (review finding, helper-74)
        direct = self._direct and buf.device.type == "cpu"
        # NCCL all-gathers in place from this rank's row; gloo's collective wants a separate input.
        mine = buf[self.rank].clone() if self._gloo and not direct else buf[self.rank]
        fault.check_agreement(f"ZeRO all_gather of {self.name}", mine, self.group)
        with fault.collective(f"ZeRO all_gather of {self.name}", self.group):  # an NCCL launch can raise
            if direct:  # Note [gloo all-gather]
                return _Works(dist.batch_isend_irecv(
                    [dist.P2POp(op, buf[row], group=self.group, group_peer=peer, tag=_GATHER_TAG)
                     for peer in range(self.world) if peer != self.rank
                     for op, row in ((dist.isend, self.rank), (dist.irecv, peer))]))
            return dist.all_gather_single(buf.view(-1), mine, group=self.group, async_op=True)

    def drop_prefetch(self) -> None:
        """Discard a prefetched all-gather (its data predates an optimizer step)."""
        if self._inflight is not None:
            for buf, work, members in self._inflight:
                fault.wait(work, f"ZeRO all_gather of {self.name}", self.group)
                if buf is None:  # gathered into the full parameters: free them again
                    for sp in members:
                        sp.free_full(self.pool)
                else:
                    self._give_back(buf)
            self._inflight = None

    def unshard(self) -> None:
        """All-gather the shards into the full parameters (cast to param_dtype)."""
        if self.is_unsharded:
            return
        self.start_unshard()
        inflight, self._inflight = self._inflight, None
        for buf, work, _ in inflight:
            fault.wait(work, f"ZeRO all_gather of {self.name}", self.group)
        if inflight[0][0] is not None and inflight[0][0].is_cuda:  # Note [ZeRO streams]: the copy-out below
            index = inflight[0][0].device.index                     # reads what the side stream wrote
            torch.cuda.current_stream(index).wait_stream(_SIDE_STREAMS[index])
        for buf, _, members in inflight:
            if buf is None:  # received straight into the full parameters (Note [gloo direct members])
                for sp in members:
                    sp.is_unsharded = True
                continue
            fulls = [sp.refill_full(self.pool) for sp in members]
            # of the buffer's dtype but under param_dtype, where a member kept another (a cast
            # through a temporary of the buffer's dtype)
            odd = {i for i, t in enumerate(fulls) if t.dtype != buf.dtype}
            outs = [torch.empty_like(t, dtype=buf.dtype) if i in odd else t for i, t in enumerate(fulls)]
            shard_copy.all_gather_copy_out(buf, outs)
            for i in odd:
                fulls[i].copy_(outs[i])
            self._give_back(buf)
            for sp in members:
                sp.is_unsharded = True

    def reshard(self) -> None:
        """Free the full parameters' storage (the shards stay)."""
        if self._inflight is not None and any(buf is None for buf, _, _ in self._inflight):
            # a gather in flight receives straight into that storage (Note [gloo direct members]):
            # wait for it and drop it before the memory goes (a backward that raised left one)
            self.drop_prefetch()
        for sp in self.members:
            sp.free_full(self.pool)

    def refresh_full(self) -> None:
        """Make every member's full parameter match its shard (after a checkpoint load wrote the shards)."""
        for sp in self.members:
            sp.is_unsharded = False  # their values predate the shards'
        self.unshard()

    # Note [gather what the step changed]: after an optimizer step ZeRO-1/2 (and ZeRO-3's root)
    # gather the updated shards back into the full parameters they keep. torch's optimizers step
    # a parameter only when it has a gradient, so the members without a shard gradient - frozen
    # ones (a LoRA fine-tune's whole base model), and those no rank used this step (Note [a
    # parameter no rank used] in _hooks.py) - are unchanged and not gathered: before, every step
    # all-gathered the frozen base too. Which members have one is the same on every rank (the
    # reductions that make them are collectives over the group; frozen parameters are frozen on
    # every rank), so every rank gathers the same layout. An optimizer that writes parameters
    # without a gradient is not covered: call refresh_full after it.
    def refresh_stepped(self) -> None:
        """After an optimizer step: gather the members it stepped (Note [gather what the step changed])."""
        for sp in self.members:
            if sp.shard.grad is not None:
                sp.is_unsharded = False  # their values predate the step
        self.unshard()

    # ---- gradients ----------------------------------------------------------------------
    def reduce_grads(self, free_full_grads: bool, async_op: bool = False) -> None:
        """Reduce-scatter the full gradients (averaged over ranks) into the shard gradients.
        With async_op, return once the reduce-scatter is launched; `finish_reduce()` waits for
        it and accumulates into the shard gradients (Note [overlapped reduce-scatter] in _hooks.py).
        Frozen members (requires_grad=False, the same on every rank) are left out: no gradient,
        no bytes moved; a group of frozen parameters alone issues no collective."""
        members = [sp for sp in self.members if sp.full.requires_grad]
        if not members:
            return
        for sp in members:  # frozen when built, trained now (Note [frozen shards keep their dtype] in _param.py)
            if sp.train_from_now():
                self.promoted.append(sp)
        for sp in members:  # Note [a parameter no rank used] in api.py
            sp.used = sp.used or sp.full.grad is not None
        grads = [sp.grad_to_reduce() for sp in members]
        direct = self._launch_direct_reduce(members, grads)  # Note [gloo direct members]
        if free_full_grads:  # the buffer below holds a copy, the direct reduction its own references
            for sp in members:
                sp.full.grad = None
        if direct is not None:
            kept = {id(sp) for sp, _, _ in direct[1]}
            grads = [g for sp, g in zip(members, grads) if id(sp) not in kept]
            members = [sp for sp in members if id(sp) not in kept]
        if not members:
            self._reducing = (None, None, None, None, [], direct)
            if not async_op:
                self.finish_reduce()
            return
        widest = functools.reduce(torch.promote_types, [g.dtype for g in grads])
        grads = [g if g.dtype == widest else g.to(widest) for g in grads]  # one dtype a call: the widest
        buf = shard_copy.reduce_scatter_copy_in(grads, self.world, self.reduce_dtype, pre_scale=1.0 / self.world,
                                                empty=self._empty(grads[0].device))
        del grads
        handle, recv = None, None
        if self.world > 1:
            fault.check_agreement(f"ZeRO reduce_scatter of {self.name}", buf, self.group)
            with fault.collective(f"ZeRO reduce_scatter of {self.name}", self.group):
                if self._direct and buf.device.type == "cpu":  # Note [gloo reduce-scatter]: host memory only
                    out = buf[self.rank]
                    empty = self._empty(buf.device) or torch.empty
                    recv = empty((self.world - 1, buf.shape[1]), dtype=buf.dtype, device=buf.device)
                    peers = [peer for peer in range(self.world) if peer != self.rank]
                    handle = _Works(dist.batch_isend_irecv(
                        [dist.P2POp(dist.isend, buf[peer], group=self.group, group_peer=peer, tag=_REDUCE_TAG)
                         for peer in peers]
                        + [dist.P2POp(dist.irecv, recv[j], group=self.group, group_peer=peer, tag=_REDUCE_TAG)
                           for j, peer in enumerate(peers)]))
                else:
                    out = buf.new_empty(buf.shape[1])  # [S]: this rank's slot
                    handle = dist.reduce_scatter_single(out, buf.view(-1), group=self.group, async_op=True)
        else:
            out = buf[0]
        self._reducing = (out, handle, buf, recv, members, direct)  # buf stays alive until the collective is done
        if not async_op:
            self.finish_reduce()

    def _launch_direct_reduce(self, members: list[ShardedParam], grads: list[torch.Tensor]):
        """Start the reduce-scatter of the members whose full gradients are sent as they are (Note
        [gloo direct members]): each peer's slice to it, its slices of ours received into a [W - 1,
        n] buffer per member. Returns (work handle, [(member, full gradient, receive buffer)]) or None."""
        chosen = [(sp, g) for sp, g in zip(members, grads)
                  if self._direct and self.world > 1 and g.device.type == "cpu" and g.dtype == self.reduce_dtype
                  and g.is_contiguous() and g.numel() * g.element_size() >= GLOO_DIRECT_MIN_BYTES]
        if not chosen:
            return None
        ops, parts = [], []
        empty = self._empty(chosen[0][1].device) or torch.empty
        for sp, g in chosen:
            flat, n, s = g.view(-1), g.numel(), sp.shard_numel
            recv = empty((self.world - 1, _real(n, s, self.rank)), dtype=g.dtype, device=g.device)
            peers = [peer for peer in range(self.world) if peer != self.rank]
            for j, peer in enumerate(peers):
                theirs = flat[peer * s:peer * s + _real(n, s, peer)]
                if theirs.numel():
                    ops.append(dist.P2POp(dist.isend, theirs, group=self.group, group_peer=peer, tag=_REDUCE_TAG))
                if recv.shape[1]:
                    ops.append(dist.P2POp(dist.irecv, recv[j], group=self.group, group_peer=peer, tag=_REDUCE_TAG))
            parts.append((sp, g, recv))
        name = f"ZeRO reduce_scatter of {self.name} (direct)"
        fault.check_agreement(name, torch.empty(sum(g.numel() for _, g in chosen), dtype=self.reduce_dtype,
                                                device="meta"), self.group)
        with fault.collective(name, self.group):
            return _Works(dist.batch_isend_irecv(ops) if ops else []), parts

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter `reduce_grads` launched, if any, and accumulate this
        rank's slot into the shard gradients."""
        if self._reducing is None:
            return
        out, handle, buf, recv, members, direct = self._reducing
        self._reducing = None
        # frozen members get no shard gradient, so the optimizer (weight decay) skips them. The
        # first reduction after zero_grad(set_to_none=True) writes the shard gradients it makes
        # rather than filling them with zeros and adding (a pass less over them, and none over
        # fresh pages: 58 ms of a Mixtral's 1.2 s ZeRO-3 step on the CPU went to those fills).
        fresh = all(sp.shard.grad is None for sp in members + ([sp for sp, _, _ in direct[1]] if direct else []))
        if direct is not None:
            self._finish_direct_reduce(*direct, fresh)
        if out is None:  # every member went direct
            return
        fault.wait(handle, f"ZeRO reduce_scatter of {self.name}", self.group)
        if recv is not None:  # Note [gloo reduce-scatter]: the other ranks' parts of this rank's row
            out.add_(recv[0] if len(recv) == 1 else recv.sum(0))
            self._give_back(recv)
        if self.offload:
            out = out.to("cpu")
        shard_copy.reduce_scatter_copy_out(out, [sp.shard_grad(overwritten=fresh) for sp in members],
                                           accumulate=not fresh)
        self._give_back(buf)  # out, a view of it or a tensor of its own, is read by now

    def _finish_direct_reduce(self, handle: _Works, parts: list, fresh: bool) -> None:
        """This rank's slice of each direct member's gradient, averaged over the ranks, into its
        shard gradient: its own part and the peers', each scaled by 1 / W and summed in the
        buffer path's order (Note [gloo direct members])."""
        fault.wait(handle, f"ZeRO reduce_scatter of {self.name} (direct)", self.group)
        scale = 1.0 / self.world
        for sp, g, recv in parts:
            s, n = sp.shard_numel, recv.shape[1]
            part = g.view(-1)[self.rank * s:self.rank * s + n] * scale
            if n:
                recv.mul_(scale)
                part.add_(recv[0] if len(recv) == 1 else recv.sum(0))
            if self.offload:
                part = part.to("cpu")
            grad = sp.shard_grad(overwritten=fresh)
            if fresh:
                grad[:n].copy_(part)
                grad[n:].zero_()
            else:
                grad[:n].add_(part)
            self._give_back(recv)
