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



# Note [carried bit for bit]: a unit of several dtypes gathers in one buffer where it can - one
# collective, not one per dtype (Note [mixed dtypes in a group]). The buffer takes the dtype of
# most of the unit's bytes; a member of another dtype whose element is a whole number of the
# buffer's (a LoRA layer's float32 adapters in a bfloat16 base's buffer: two words each) is
# carried in it bit for bit, its shard read as the buffer's words and its gathered rows read
# back as its own dtype - nothing rounded: an all-gather only moves bytes, and so do the copy
# kernels between tensors of one dtype (the CUDA ones copied through float, which rewrote a word
# that reads as a NaN: review finding, helper-81; csrc/cuda/shard_copy_kernels.cu). Its rows are
# written whole into a temporary (a carried shard of n elements is 2n words; the copy-out would
# lay 2n words of a tensor out as rows of ceil(2n / world), not 2 ceil(n / world)), then copied
# into the parameter. On the bench's bfloat16 Llama with LoRA r=8 at dp=2 (gloo; bench_hf.py
# --lora 8) the second gather per unit made 18 collectives a step where float32 made 10
# (helper-80); carried, ZeRO-3's step went from 241 to 206-219 ms and from 0.98 to 0.91 of
# FSDP2's. A dtype narrower than the buffer's keeps a gather of its own.
def _carried(kinds: dict[torch.dtype, list]) -> list[tuple[torch.dtype, list[tuple]]]:
    """The all-gathers of a unit whose members are gathered in `kinds`' dtypes: [(buffer dtype,
    [(member, its own dtype where carried bit for bit, else None)])], the same on every rank."""
    if len(kinds) == 1:
        return [(dtype, [(sp, None) for sp in members]) for dtype, members in kinds.items()]
    main = max(kinds, key=lambda d: sum(sp.full.numel() for sp in kinds[d]) * d.itemsize)
    gathers = [(main, [(sp, None) for sp in kinds[main]])]
    for dtype, members in kinds.items():
        if dtype == main:
            continue
        if dtype.itemsize % main.itemsize == 0:
            gathers[0][1].extend((sp, dtype) for sp in members)
        else:
            gathers.append((dtype, [(sp, None) for sp in members]))
    return gathers

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
        # [(buffer, work handle, [(member, the dtype it is carried in or None)])] of the all-gathers
        # started by prefetch
        self._inflight = None
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
            for dtype, members in _carried(kinds):
                shards = []
                for sp, own in members:
                    # frozen shards beside float32 masters: each in the dtype it is gathered in
                    # (Note [frozen shards keep their dtype]); a carried one then read as the buffer's words
                    t = sp.gather_input(device).to(own or dtype)
                    shards.append(t.reshape(-1).view(dtype) if own is not None else t)
                buf = shard_copy.all_gather_copy_in(shards, self.world, self.rank, dtype,
                                                    empty=self._empty(device, gather=True))
                inflight.append((buf, self._launch_all_gather(buf), members))
        self._inflight = inflight

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
            for buf, work, _ in self._inflight:
                fault.wait(work, f"ZeRO all_gather of {self.name}", self.group)
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
        if inflight[0][0].is_cuda:  # Note [ZeRO streams]: the copy-out below reads what the side stream wrote
            index = inflight[0][0].device.index
            torch.cuda.current_stream(index).wait_stream(_SIDE_STREAMS[index])
        for buf, _, members in inflight:
            outs, through = [], []  # (full, the temporary it is written through)
            for sp, own in members:
                full = sp.refill_full(self.pool)
                if own is not None:  # carried (Note [carried bit for bit]): its padded rows in its own dtype
                    rows = torch.empty(self.world * shard_copy.shard_numel(full.numel(), self.world), dtype=own,
                                       device=buf.device)
                    outs.append(rows.view(buf.dtype))
                    through.append((full, rows[:full.numel()].view(full.shape)))
                elif full.dtype != buf.dtype:  # under param_dtype, a member that kept another: cast through
                    outs.append(torch.empty_like(full, dtype=buf.dtype))  # a temporary of the buffer's dtype
                    through.append((full, outs[-1]))
                else:
                    outs.append(full)
            shard_copy.all_gather_copy_out(buf, outs)
            for full, temporary in through:
                full.copy_(temporary)
            self._give_back(buf)
            for sp, _ in members:
                sp.is_unsharded = True

    def reshard(self) -> None:
        """Free the full parameters' storage (the shards stay)."""
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
            sp.used = sp.used or sp.has_grad()
        grads = [sp.grad_to_reduce() for sp in members]
        widest = functools.reduce(torch.promote_types, [g.dtype for g in grads])
        grads = [g if g.dtype == widest else g.to(widest) for g in grads]  # one dtype a call: the widest
        buf = shard_copy.reduce_scatter_copy_in(grads, self.world, self.reduce_dtype, pre_scale=1.0 / self.world,
                                                empty=self._empty(grads[0].device))
        del grads
        if free_full_grads:  # buf holds their copy
            for sp in members:
                sp.forget_grad()
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
        self._reducing = (out, handle, buf, recv, members)  # buf stays alive until the collective is done
        if not async_op:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter `reduce_grads` launched, if any, and accumulate this
        rank's slot into the shard gradients."""
        if self._reducing is None:
            return
        out, handle, buf, recv, members = self._reducing
        self._reducing = None
        fault.wait(handle, f"ZeRO reduce_scatter of {self.name}", self.group)
        if recv is not None:  # Note [gloo reduce-scatter]: the other ranks' parts of this rank's row
            out.add_(recv[0] if len(recv) == 1 else recv.sum(0))
            self._give_back(recv)
        if self.offload:
            out = out.to("cpu")
        # frozen members get no shard gradient, so the optimizer (weight decay) skips them. The
        # first reduction after zero_grad(set_to_none=True) writes the shard gradients it makes
        # rather than filling them with zeros and adding (a pass less over them, and none over
        # fresh pages: 58 ms of a Mixtral's 1.2 s ZeRO-3 step on the CPU went to those fills).
        fresh = all(sp.shard.grad is None for sp in members)
        shard_copy.reduce_scatter_copy_out(out, [sp.shard_grad(overwritten=fresh) for sp in members],
                                           accumulate=not fresh)
        self._give_back(buf)  # out, a view of it or a tensor of its own, is read by now
