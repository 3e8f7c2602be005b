"""One parameter group: the parameters of one wrapped module, sharded together.

Note [ZeRO param group]: every parameter is flattened, padded to a multiple of the world
size W and cut into W shards (the layout of parallel_layers/ops/shard_copy.py). This rank
keeps its shard of each as a float32 master (`shards`, what the optimizer steps). The
module keeps its ordinary nn.Parameters ("full" params): under stage 3 their storage is
resized to zero between uses and refilled by `unshard()` - autograd's saved references to
the same storage see the data again once it is refilled. One all-gather fills a group; one
reduce-scatter turns the group's full gradients into shard gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault
from parallel_layers.ops import shard_copy


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the shard-copy kernels take


def check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> None:
    """Raise unless the gather (param) and reduce dtypes are ones the shard-copy kernels take."""
    if param_dtype is not None and param_dtype not in _DTYPES:
        raise ValueError(f"param_dtype must be None (keep the parameters' dtype) or one of {list(_DTYPES)}, got "
                         f"{param_dtype!r}")
    if reduce_dtype not in _DTYPES:
        raise ValueError(f"reduce_dtype must be one of {list(_DTYPES)}, got {reduce_dtype!r}")


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


def _all_gather_stream(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    stream.wait_stream(torch.cuda.current_stream(index))
    return torch.cuda.stream(stream)


def _own_storage(p: nn.Parameter) -> None:
    """Note [memory-mapped parameters]: `from_pretrained` hands out parameters whose storage is
    the memory-mapped safetensors file, which cannot be resized ("Trying to resize storage that
    is not resizable"). Stage 3 frees a full parameter by resizing its storage to zero, so such
    a parameter is first copied into storage of its own - once, at construction, before any
    forward has saved a reference to it."""
    if not p.untyped_storage().resizable():
        p.data = p.data.clone()


class ParamGroup:
    def __init__(self, name: str, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, alias_full: bool,
                 offload: bool = False):
        self.name, self.params, self.group = name, params, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.offload = offload  # ZeRO-Offload: shards, their grads and the optimizer on the CPU
        if not alias_full:  # stage 3 frees the full parameters' storage between uses
            for p in params:
                _own_storage(p)
        self.numels = [p.numel() for p in params]
        self.shard_sizes = [shard_copy.shard_numel(n, self.world) for n in self.numels]
        self.total = sum(self.shard_sizes)
        self.shards = [nn.Parameter(self._my_shard(p, alias_full and not offload), requires_grad=p.requires_grad)
                       for p in params]
        self.is_unsharded = True
        self._inflight = None  # (buffer, work handle) of an all-gather started by prefetch
        self._gloo = dist.get_backend(group) == "gloo"

    def _my_shard(self, p: Tensor, alias_full: bool) -> Tensor:
        """This rank's float32 master shard of p.

        When the full parameter stays allocated (stages 1 and 2), is float32, contiguous and
        divides evenly by the world size, the shard is a view of its own slice of the full
        parameter rather than a copy: the optimizer updates that slice in place and the
        all-gather after the step rewrites it with the same values. That keeps stage 1/2
        memory at the ZeRO paper's figures instead of one extra float32 copy of 1/W.
        """
        s = shard_copy.shard_numel(p.numel(), self.world)
        if (alias_full and p.dtype == torch.float32 and p.is_contiguous() and p.numel() == s * self.world
                and self.param_dtype in (None, torch.float32)):
            return p.detach().view(-1)[self.rank * s:(self.rank + 1) * s]
        flat = torch.nn.functional.pad(p.detach().reshape(-1).float(), (0, s * self.world - p.numel()))
        shard = flat[self.rank * s:(self.rank + 1) * s].clone()
        if self.offload:
            shard = shard.cpu().pin_memory() if torch.cuda.is_available() else shard.cpu()
        return shard

    # ---- parameters ---------------------------------------------------------------------
    def start_unshard(self) -> None:
        """Launch the all-gather of this group without waiting (prefetch); no-op if unsharded."""
        if self.is_unsharded or self._inflight is not None:
            return
        dtype = self.param_dtype or self.params[0].dtype
        device = self.params[0].device
        with _all_gather_stream(device):
            shards = [s.detach().to(device, non_blocking=True) for s in self.shards]  # no-op unless offloaded
            buf = shard_copy.all_gather_copy_in(shards, self.world, self.rank, dtype)
            work = None
            if self.world > 1:
                # NCCL all-gathers in place from this rank's row; gloo wants a separate input.
                mine = buf[self.rank].clone() if self._gloo else buf[self.rank]
                fault.check_agreement(f"ZeRO all_gather of {self.name}", mine, self.group)
                with fault.collective(f"ZeRO all_gather of {self.name}", self.group):  # an NCCL launch can raise
                    work = dist.all_gather_single(buf.view(-1), mine, group=self.group, async_op=True)
        self._inflight = (buf, work)

    def drop_prefetch(self) -> None:
        """Discard a prefetched all-gather (its data predates an optimizer step)."""
        if self._inflight is not None:
            _, work = self._inflight
            fault.wait(work, f"ZeRO all_gather of {self.name}", self.group)
            self._inflight = None

    def unshard(self) -> None:
        """All-gather the shards into the full parameters (cast to param_dtype)."""
        if self.is_unsharded:
            return
        self.start_unshard()
        buf, work = self._inflight
        self._inflight = None
        fault.wait(work, f"ZeRO all_gather of {self.name}", self.group)
        if buf.is_cuda:  # Note [ZeRO streams]: the copy-out below reads what the side stream wrote
            index = buf.device.index
            torch.cuda.current_stream(index).wait_stream(_SIDE_STREAMS[index])
        for p in self.params:
            storage = p.untyped_storage()
            if storage.size() == 0:
                storage.resize_(p.numel() * p.element_size())
        shard_copy.all_gather_copy_out(buf, [p.data for p in self.params])
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the full parameters' storage (stage 3); the shards stay."""
        if not self.is_unsharded:
            return
        for p in self.params:
            p.untyped_storage().resize_(0)
        self.is_unsharded = False

    def refresh_full(self) -> None:
        """After an optimizer step: make the full parameters match the updated shards."""
        self.is_unsharded = False
        self.unshard()

    # ---- gradients ----------------------------------------------------------------------
    def reduce_grads(self, free_full_grads: bool) -> None:
        """Reduce-scatter the full gradients (averaged over ranks) into the shard gradients."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format)
                 for p in self.params]
        grads = [g.contiguous() for g in grads]
        buf = shard_copy.reduce_scatter_copy_in(grads, self.world, self.reduce_dtype, pre_scale=1.0 / self.world)
        if self.world > 1:
            out = buf.new_empty(self.total)
            fault.check_agreement(f"ZeRO reduce_scatter of {self.name}", buf, self.group)
            with fault.collective(f"ZeRO reduce_scatter of {self.name}", self.group):
                dist.reduce_scatter_single(out, buf.view(-1), group=self.group)
        else:
            out = buf[0]
        for s in self.shards:
            if s.grad is None:
                s.grad = torch.zeros_like(s)
        if self.offload:
            out = out.to("cpu")
        shard_copy.reduce_scatter_copy_out(out, [s.grad for s in self.shards], accumulate=True)
        if free_full_grads:
            for p in self.params:
                p.grad = None

    def full_param_bytes(self) -> int:
        return sum(p.untyped_storage().size() for p in self.params)

    def shard_bytes(self) -> int:
        """Bytes of master shards that are not views of a full parameter."""
        full = {p.untyped_storage().data_ptr() for p in self.params}
        return sum(s.numel() * s.element_size() for s in self.shards
                   if s.untyped_storage().data_ptr() not in full)
