"""`ShardedParam`: one parameter sharded over a process group, the unit ZeRO is built from.

    sp = ShardedParam(layer.weight, group)     # the full tensor's storage is freed now
    handle = sp.unshard(async_op=True)         # all-gather in flight
    ...                                        # other work
    handle.wait()                              # layer.weight holds the full values again
    loss.backward(); sp.reduce_grad()          # averaged gradient lands in sp.shard.grad
    sp.reshard()                               # frees the full storage again

Note [ZeRO sharded parameter]: the parameter is flattened, padded to a multiple of the world
size W and cut into W shards of ceil(numel / W) elements (the layout of
parallel_layers/ops/shard_copy.py), whatever its shape: a [7, 15] weight over 4 ranks is 27
elements each, where a dim-0 split would give 2 rows to three ranks and 1 real row plus
padding to the last. This rank keeps its shard as a float32 master (`shard`, what the
optimizer steps) - a frozen one in its own dtype (Note [frozen shards keep their dtype]). The
module keeps its ordinary nn.Parameter (`full`): where it is freed between uses (ZeRO-3), its
storage is resized to zero and refilled by an all-gather - autograd's saved references to the
same storage see the data again once it is refilled.

Note [frozen shards keep their dtype]: a parameter frozen when ZeRO is built (requires_grad
False: a LoRA fine-tune's base model, a frozen embedding) is never stepped, so a float32 master
would only hold its values at twice a bfloat16 model's bytes: ZeRO-3 kept 4 / N bytes a frozen
parameter on each rank where FSDP2 keeps 2 / N (70B bfloat16 weights over 8 ranks: 35 GB
against 17.5). Its shard is kept in the parameter's own dtype instead (exactly the values
loaded; no rounding) and at ZeRO-1/2 is a view of the full parameter (no copy at all). A unit
holding both kinds (a LoRA layer: its frozen base weight and float32 adapter masters) casts the
shards of the other dtype to the gather's before the copy-in. Unfrozen later, the shard becomes
a float32 master at its first reduction (`train_from_now`), and optimizer state built for it
in the optimizer's constructor (Adagrad's sum) is cast with it (ZeRO.step).

Note [storage shared within a group]: SwiGLUMLP keeps its gate and up weights in one
allocation so that its GEMM reads [gate; up] as a view (tensor_parallel/layers.py). When
every parameter sharing a storage is a member of the same ParamGroup (ZeRO builds that from
the wrapped module), the group frees and refills them together, so they keep sharing it:
freeing resizes the one storage to zero, the first member's refill gives back all of its
bytes, and the copy-out writes each member's slice. Otherwise (members in different groups,
or a param_dtype cast, which gives each parameter storage of its own) each is copied into
storage of its own, and the fused MLP copies gate and up together per call instead.

A ShardedParam holds the per-parameter half of that: sizes, the master shard, freeing and
refilling the full storage, and what the gather and reduction read and write for it. The
collectives live in ParamGroup (_group.py), which batches many ShardedParams into one
all-gather and one reduce-scatter; on its own (the usage above) a ShardedParam is a group
of one.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from parallel_layers import _grad_bank
from parallel_layers.ops import shard_copy
from parallel_layers.zero._group import BufferPool, ParamGroup

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the shard-copy kernels take


def check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> None:
    """Raise unless the gather (param) and reduce dtypes are ones the shard-copy kernels take."""
    if param_dtype is not None and param_dtype not in _DTYPES:
        raise ValueError(f"param_dtype must be None (keep the parameters' dtype) or one of {list(_DTYPES)}, got "
                         f"{param_dtype!r}")
    if reduce_dtype not in _DTYPES:
        raise ValueError(f"reduce_dtype must be one of {list(_DTYPES)}, got {reduce_dtype!r}")


# Note [reading a freed parameter]: between its uses a ZeRO-3 parameter keeps its shape,
# dtype and device but has no storage (ShardedParam.free_full). Read directly
# (`layer.weight.norm()`, `print(model.lm_head.weight)`, `copy.deepcopy(model)`), its data
# pointer is null and a kernel dereferences it: SIGSEGV on a CPU, an illegal address on a
# GPU, either killing the process without a word. torch's own CUDA-graph trees meet the same
# problem for the outputs they reclaim and answer it by marking the storage so that asking it
# for its data pointer raises; so does free_full, with a message naming what works instead,
# and refill_full clears the mark before giving the bytes back. Only what reads the values
# asks for the pointer: shapes, dtype, device, `numel()`, `zeros_like`, views and autograd's
# saved references are untouched. The mark costs well under a microsecond a parameter. Older
# torch builds without the two private functions keep the crash (the test skips there).
# torch.profiler's Python tracer (`with_stack=True`) asks for the data pointer of every
# parameter of each module it sees called - before the module's hooks have gathered them - and
# raised the mark's error in the first profiled forward (session 39: ZeRO-3 could not be
# profiled with stacks). So the marks are off while that tracer runs (it installs its
# TraceContext as the thread's profile function: `python_tracer_on`): ZeRO-3 looks at the start
# of each forward, of each pipeline step and at the end of each backward
# (`ZeROHooks.profiler_check`), clears the marks of freed parameters while the tracer is on
# and sets them again once it is off. Meanwhile a freed parameter read directly crashes, as
# without the marks; a profiler without stacks leaves the marks alone.
_FREED_MESSAGE = (
    "this parameter's full values are not in memory: ZeRO-3 (parallel_layers' zero_stage=3) keeps only this "
    "rank's shard between uses. Read the full parameters through ZeRO on every rank - "
    "parallel_layers.zero.ZeRO.full_state_dict(), parallel_layers.checkpoint.save(...) or "
    "parallel_layers.hf.save_pretrained(par.module, directory) - or train at zero_stage 1 or 2, which keep them whole")
_MARK = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
_UNMARK = getattr(torch._C, "_clear_storage_data_ptr_access_error_msg", None)
MARKS_FREED = _MARK is not None and _UNMARK is not None


def python_tracer_on() -> bool:
    """Whether torch.profiler's Python tracer (with_stack=True) runs in this thread (Note
    [reading a freed parameter])."""
    return type(sys.getprofile()).__name__ == "TraceContext"


def _poison(storage: torch.UntypedStorage) -> None:
    if MARKS_FREED:
        _MARK(storage._cdata, _FREED_MESSAGE)


def _unpoison(storage: torch.UntypedStorage) -> None:
    if MARKS_FREED:
        _UNMARK(storage._cdata)


class UnshardHandle:
    """What `ShardedParam.unshard(async_op=True)` returns: `wait()` completes the gather."""

    def __init__(self, group: ParamGroup):
        self._group = group

    def wait(self) -> None:
        self._group.unshard()


class ShardedParam:
    """`param` sharded over `group` (Note [ZeRO sharded parameter]).

    param_dtype: the dtype the full parameter is cast to and gathered in (None: keep its own);
    the master shard is float32 either way. reduce_dtype: the dtype gradients are averaged in.
    ZeRO's knobs, for the groups it builds:
      keep_full   the full parameter stays allocated (ZeRO-1/2, and ZeRO-3's root group);
                  by default it is freed now and between uses.
      alias_full  with keep_full, the shard may be a view of the full parameter's own slice
                  (ZeRO-1/2; see `_master_shard`).
      offload     the shard and its gradient live on the CPU (ZeRO-Offload).
      storage_shared_in_group  the parameter's storage is shared with other members of its
                  group and with nothing else (Note [storage shared within a group]).
    """

    def __init__(self, param: nn.Parameter, group: dist.ProcessGroup | None = None, *,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 keep_full: bool = False, alias_full: bool = False, offload: bool = False,
                 storage_shared_in_group: bool = False):
        check_dtypes(param_dtype, reduce_dtype)
        if not dist.is_initialized():
            raise RuntimeError("ShardedParam needs torch.distributed to be initialised")
        if not param.is_floating_point():
            raise TypeError(f"ShardedParam shards floating-point parameters only (a float32 master shard, "
                            f"floating gather buffers); got a {str(param.dtype).removeprefix('torch.')} parameter "
                            f"of shape {tuple(param.shape)}: keep it whole (a buffer)")
        if alias_full and not keep_full:
            raise ValueError("alias_full needs keep_full: a shard that is a view of the full parameter would be "
                             "freed with it")
        self.full, self.group = param, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # since the last step: a gradient of this rank was reduced; the shard gradient was made by
        # those reductions (Note [a parameter no rank used] in api.py)
        self.used, self.grad_made = False, False
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.keep_full, self.offload = keep_full, offload
        self.shard_numel = shard_copy.shard_numel(param.numel(), self.world)
        self.storage_shared = storage_shared_in_group and param_dtype in (None, param.dtype)
        if not alias_full:
            self._own_storage()
        # Note [frozen shards keep their dtype]
        self.master_dtype = torch.float32 if param.requires_grad else param.dtype
        self.shard = nn.Parameter(self._master_shard(alias_full and not offload), requires_grad=param.requires_grad)
        if param_dtype is not None:
            param.data = param.data.to(param_dtype)
        # Note [accumulating in the reduce dtype]: earlier backward passes' gradient, summed in
        # reduce_dtype, while this parameter is gathered in a narrower param_dtype - a frozen one
        # too, for when it is unfrozen
        self.banks = (param_dtype is not None and param.is_floating_point()
                      and torch.finfo(param_dtype).bits < torch.finfo(reduce_dtype).bits)
        if self.banks:
            _grad_bank.enable(param, reduce_dtype)
        # what refill_full gives back: the bytes of the parameter as gathered (after the cast; taken
        # before it, a bfloat16 parameter was refilled at its float32 size, twice what it needs)
        self._storage_nbytes = param.untyped_storage().nbytes()
        self.is_unsharded = True  # `full` holds the current values (False: freed, or stale after a step)
        self.mark_when_freed = True  # Note [reading a freed parameter]: False while a profiler runs
        self._alone: ParamGroup | None = None  # the group of one behind unshard / reduce_grad
        if not keep_full and not self.storage_shared:  # shared: freed by ZeRO once every member has its shard
            self.free_full()

    def _own_storage(self) -> None:
        """Note [memory-mapped parameters]: `from_pretrained` hands out parameters whose storage is
        the memory-mapped safetensors file, which cannot be resized ("Trying to resize storage that
        is not resizable"). Stage 3 frees a full parameter by resizing its storage to zero, so such
        a parameter is first copied into storage of its own - once, at construction, before any
        forward has saved a reference to it. So is one that shares its storage with another
        parameter (SwiGLUMLP packs gate and up weights into one): resizing it would free both -
        unless they are all members of one group (Note [storage shared within a group])."""
        storage = self.full.untyped_storage()
        alone = storage.nbytes() == self.full.numel() * self.full.element_size()
        if not storage.resizable() or not (alone or self.storage_shared):
            self.full.data = self.full.data.clone()

    def _master_shard(self, alias: bool) -> Tensor:
        """This rank's master shard of the full parameter, in `master_dtype` (float32; a frozen
        parameter's own dtype).

        When the full parameter stays allocated (stages 1 and 2), is of the master's dtype,
        contiguous and divides evenly by the world size, the shard is a view of its own slice of
        the full parameter rather than a copy: the optimizer updates that slice in place and the
        all-gather after the step rewrites it with the same values. That keeps stage 1/2
        memory at the ZeRO paper's figures instead of one extra float32 copy of 1/W.
        """
        p, s, dtype = self.full, self.shard_numel, self.master_dtype
        self.aliases_full = (alias and p.dtype == dtype and p.is_contiguous() and p.numel() == s * self.world
                             and self.param_dtype in (None, dtype))
        if self.aliases_full:
            return p.detach().view(-1)[self.rank * s:(self.rank + 1) * s]
        if p.is_meta:  # built on the meta device: storage comes with `materialize`
            return torch.empty(s, dtype=dtype, device="meta")
        shard = self._part(p, dtype)
        if self.offload:
            shard = shard.cpu().pin_memory() if torch.cuda.is_available() else shard.cpu()
        return shard

    def materialize(self, device: torch.device | str) -> None:
        """A parameter built on the meta device gets zero-filled storage on `device`, in place
        (parallel_layers/meta.py): the master shard (on the CPU when offloaded; a view of the
        full parameter where it aliases it), and the full parameter - freed again at once unless
        kept, so ZeRO-3 never holds a whole parameter here. The values are the caller's to
        write into the shard (a load), followed by a gather."""
        from parallel_layers.meta import empty_like, swap_in

        if self.full.is_meta:
            swap_in(self.full, empty_like(self.full, device))
            self._storage_nbytes = self.full.untyped_storage().nbytes()
            self.is_unsharded = False  # the values are still to come
            if not self.keep_full:
                self.free_full()
        if self.shard.is_meta:
            if self.aliases_full:
                shard = self.full.detach().view(-1)[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
            else:
                shard = torch.empty(self.shard_numel, dtype=self.master_dtype, device="cpu" if self.offload else device)
                if self.offload and torch.cuda.is_available():
                    shard = shard.pin_memory()
            swap_in(self.shard, shard)

    def _part(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """This rank's part of a tensor shaped like the full parameter: flattened, padded to
        world * shard_numel, its slice (a copy, in `dtype`)."""
        s = self.shard_numel
        flat = F.pad(t.detach().reshape(-1).to(dtype), (0, s * self.world - t.numel()))
        return flat[self.rank * s:(self.rank + 1) * s].clone()

    def cut(self, t: Tensor) -> Tensor:
        """`t`, shaped like the full parameter, cut as the master shard is, in the shard's dtype
        and on its device: what ZeRO makes of optimizer state built for the full parameter (Note
        [an optimizer over shards])."""
        return self._part(t, self.shard.dtype).to(self.shard.device)

    # ---- the full parameter's storage ------------------------------------------------------
    def free_full(self, pool: BufferPool | None = None) -> None:
        """Resize the full parameter's storage to zero (the shard stays); reading it until the
        next refill raises (Note [reading a freed parameter]). With a pool, its memory is kept
        there for the next refill (Note [CPU parameter storage reuse] in _group.py)."""
        storage = self.full.untyped_storage()
        if storage.nbytes():  # shared within the group: the first member frees it for all
            if pool is not None:
                pool.free_storage(storage)
            else:
                storage.resize_(0)
            if self.mark_when_freed:
                _poison(storage)
        self.is_unsharded = False

    def set_marking(self, on: bool) -> None:
        """Mark freed storage from now on (on) or not, and (un)mark it now if it is freed (Note
        [reading a freed parameter])."""
        self.mark_when_freed = on
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0 and self._storage_nbytes:
            (_poison if on else _unpoison)(storage)

    def refill_full(self, pool: BufferPool | None = None) -> Tensor:
        """Give the full parameter its storage back (values still to be written; from the pool's
        kept memory where it has some); returns the tensor the all-gather's copy-out writes."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0 and self._storage_nbytes:  # shared: the first member refills it for all
            _unpoison(storage)
            if pool is not None:
                pool.refill_storage(storage, self._storage_nbytes)
            else:
                storage.resize_(self._storage_nbytes)
        return self.full.data

    # ---- what the collectives read and write -----------------------------------------------
    def gather_input(self, device: torch.device) -> Tensor:
        """The shard as the all-gather's copy-in reads it: on the compute device (a copy only
        when offloaded)."""
        return self.shard.detach().to(device, non_blocking=True)

    # Note [accumulating in the reduce dtype]: with param_dtype narrower than reduce_dtype
    # (parallelize's param_dtype=torch.bfloat16: Note [mixed precision by the parameters]), the
    # full parameter's .grad is bfloat16, and autograd adds every backward pass of a step into it
    # there - a pipeline's or `microbatches`' microbatches, backward passes under no_sync, ZeRO-1's
    # passes before its step - rounding each sum to bfloat16 (helper-86: 0.016 off the trained
    # tensors of a float32-accumulating reference after 3 steps of 2 microbatches). FSDP2 adds them
    # in its reduce dtype. So does ZeRO now: a hook that runs before autograd accumulates a new
    # gradient moves the one already there into a float32 bank on the parameter (parallel_layers/
    # _grad_bank.py), one that runs after it adds each later pass's gradient to the bank, and the
    # reduction reads the bank (and a .grad), as does the pipeline's sum of a tied weight's copies
    # (helper-87: it read the last pass's .grad alone, 40% off). One backward pass a step never
    # finds a gradient there, and costs nothing; several hold 4 bytes a parameter, as FSDP2's
    # float32 accumulation without reducing and Megatron's main_grad do (6 before the second hook:
    # the bank and the latest pass's .grad). A model loaded in bfloat16 without
    # param_dtype accumulates in its .grad, as plain bfloat16 training (the tests' reference for
    # it) does. A parameter frozen at build gets the hook too (registered while it briefly
    # requires grad, which autograd keeps): unfrozen later, it banks as the others do. After two
    # or more passes a banked parameter's .grad is None (its gradient is the bank): torch's own
    # clip_grad_norm_ over the full parameters sees nothing there, as under ZeRO-2/3 it never
    # did; ZeRO's clip_grad_norm_ reduces first and reads the shards.
    def __setstate__(self, state: dict) -> None:
        # a copy (deepcopy of the model and its ZeRO, pickling) gets parameters without torch's
        # hooks or attributes: the copy's parameter banks its gradients too (helper-87)
        self.__dict__.update(state)
        if self.banks:
            _grad_bank.enable(self.full, self.reduce_dtype)

    def has_grad(self) -> bool:
        return self.full.grad is not None or _grad_bank.banked(self.full) is not None

    def forget_grad(self) -> None:
        self.full.grad = None
        _grad_bank.set_banked(self.full, None)

    def grad_to_reduce(self) -> Tensor:
        """The full gradient as the reduce-scatter's copy-in reads it: zeros where this rank
        has none (Note [ZeRO unused parameters] in _hooks.py); with gradients banked in the
        reduce dtype (Note [accumulating in the reduce dtype]), their sum there, taken."""
        p = self.full
        if _grad_bank.banked(p) is not None:
            return _grad_bank.take(p).contiguous()
        grad = p.grad if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format)
        return grad.contiguous()

    def train_from_now(self) -> bool:
        """A parameter frozen when built is being trained (its gradient is being reduced): its
        shard becomes a float32 master (Note [frozen shards keep their dtype]). True if it changed."""
        if self.master_dtype == torch.float32:
            return False
        self.shard.data = self.shard.detach().to(torch.float32)  # a copy: no longer a view of the full parameter
        self.master_dtype, self.aliases_full = torch.float32, False
        return True

    def shard_grad(self, overwritten: bool = False) -> Tensor:
        """The shard's gradient, which the reduce-scatter's copy-out accumulates into; made
        uninitialized where there is none and the copy-out will overwrite it (`overwritten`)."""
        if self.shard.grad is None:
            self.shard.grad = (torch.empty_like if overwritten else torch.zeros_like)(self.shard)
            self.grad_made = True
        return self.shard.grad

    # ---- on its own: a group of one --------------------------------------------------------
    def _group_of_one(self) -> ParamGroup:
        if self._alone is None:
            self._alone = ParamGroup("param", [self])
        return self._alone

    def unshard(self, async_op: bool = False) -> UnshardHandle:
        """Gather the full parameter; with async_op, return before the gather completes."""
        group = self._group_of_one()
        group.start_unshard()
        handle = UnshardHandle(group)
        if not async_op:
            handle.wait()
        return handle

    def reshard(self) -> None:
        """Free the full parameter's storage (the shard stays)."""
        self._group_of_one().reshard()

    def reduce_grad(self) -> None:
        """Average `full.grad` over the group into `shard.grad` (accumulating) and free it."""
        self._group_of_one().reduce_grads(free_full_grads=True)
