"""Megatron-style tensor-parallel linear layers as plain modules over plain tensors.

Shapes: x [..., in] for the column layer, [..., in / tp] for the row layer (input_is_parallel).
With sequence parallelism, activations are sharded on the sequence dim `seq_dim` outside the
column -> row pair, and whole inside it: dim 0 for [seq, batch, hidden] (the default), 1 for
Hugging Face's [batch, seq, hidden] (comm.py, Note [strided sequence chunks]).

  ColumnParallelLinear  weight [out / tp, in]: y_r = act(x A_r^T + b_r), output sharded on
                        the last dim. Backward all-reduces (SP: reduce-scatters) grad-input,
                        launched asynchronously and overlapped with the weight-gradient GEMM.
                        shared_input=True: the layer's input is its region's, read by
                        every column layer of the region (q, k and v), and the region's
                        entry does the input's collective once for all of them: under SP
                        the sequence gather (comm.gather_from_sp, whose backward
                        reduce-scatters), else comm.copy_to_tp (whose backward
                        all-reduces). The layer neither gathers nor reduces: its input
                        gradient is a partial sum (Note [one reduction per region]).
  RowParallelLinear     weight [out, in / tp]: partial outputs all-reduced (SP:
                        reduce-scattered); the replicated bias is added once, after.
                        input_is_parallel=False: the input is whole, [..., in], the same
                        on every rank (a column layer gathered its output); the layer
                        takes this rank's slice of its features (backward: all-gathers
                        the input gradient on the features). With SP that input holds
                        the whole sequence, and the output this rank's chunk of it.

Collectives per layer (docs/parallelism.md): column 0 forward / 1 backward; row 1 / 0;
column+SP 1 all-gather / 1 reduce-scatter; row+SP 1 reduce-scatter / 1 all-gather (plus one
all-reduce of the row bias gradient, which is partial under SP); a row layer with
input_is_parallel=False one more all-gather in backward (its input gradient's features).

Initialisation does not depend on the TP size: each rank builds the full weight with
`init_method` (default: nn.Linear's) and keeps its shard, so with the same seed the gathered
weight equals the tp=1 (and nn.Linear) weight.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import fault
from parallel_layers.ops import (bias_gelu_backward, linear_autocast_inputs, linear_forward, linear_gelu_forward,
                                 linear_input_grad, linear_swiglu_forward, linear_weight_grad, swiglu_backward)
from parallel_layers.tensor_parallel import comm
from parallel_layers.tensor_parallel.sharding import (check_divisible, check_size, gather_full, keep_requires_grad,
                                                      sharded_parameter)

_ACTIVATIONS = {None: None, "gelu": "none", "gelu_tanh": "tanh"}


def _default_init(weight: Tensor, bias: Tensor | None) -> None:
    """nn.Linear's initialisation, on the full (unsharded) tensors, in nn.Linear's RNG order."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def _init_full(out_features, in_features, bias, device, dtype, init_method):
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    b = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if weight.device.type != "meta":
        if init_method is None:
            _default_init(weight, b)
        else:
            init_method(weight)
            if b is not None:
                nn.init.zeros_(b)
    return weight, b


def reduce_grad_over_tp(param: nn.Parameter, group: dist.ProcessGroup | None) -> None:
    """Sum `param`'s gradient over the TP group as it is produced (before accumulation).

    For replicated parameters that see only part of the data under sequence parallelism
    (LayerNorm weights, the row bias): each rank's gradient covers its sequence chunk only.
    """
    if comm.group_size(group) == 1 or getattr(param, "_pl_tp_grad_hook", False):
        return
    if not (param.is_floating_point() or param.is_complex()):  # an integer table never has a gradient
        return

    def hook(grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group)
        return grad

    # a frozen parameter takes no hook; registered while it requires grad, the hook stays for
    # when the user unfreezes it
    frozen = not param.requires_grad
    param.requires_grad_(True)
    param.register_hook(hook)
    param.requires_grad_(not frozen)
    param._pl_tp_grad_hook = True


# The Functions below write their own backward, to overlap collectives with the GEMMs; the
# kernel contracts stay the ops' (docs/kernels.md): the layers cast their inputs with
# linear_autocast_inputs before the Function (the autocast policy), the forward GEMM is
# linear_forward / linear_gelu_forward / linear_swiglu_forward, and backward computes dz,
# dbias and the GEMMs with bias_gelu_backward / swiglu_backward, linear_input_grad and
# linear_weight_grad (the linear + GeLU and linear + SwiGLU backward rules) - every GEMM by the
# library's CPU GEMM rules (csrc/gemm.cpp).


# Note [re-gathering the sequence in backward]: under sequence parallelism a column layer's
# input is the sequence gathered from every rank's chunk (by the layer itself, input_comm
# "sequence", or by its region's entry, comm.gather_from_sp), and its weight gradient needs that
# whole input. Keeping it from forward to backward kept e * h bytes a token per region whole on
# every rank - the memory sequence parallelism exists to split (the planner measured it: 1.10 of
# its estimate at tp=2, helper-89). As Megatron-LM does, the layer saves this rank's chunk
# instead and gathers it again in backward, launched before the input-gradient GEMM and waited
# for before the weight-gradient one, which needs it. The entry tags its output with the chunk
# (`_pl_sp_chunk`: the chunk, group, dim and both tensors' versions); a tensor without the tag
# (a cast under autocast, an input from elsewhere), or whose chunk or itself was changed in place
# since the gather (helper-90: the chunk saved then gave a weight gradient 50-100% off), is saved
# as it is. A chunk changed in place after the layer's forward is refused by autograd's version
# check in backward ("modified by an inplace operation"), where the whole input saved before
# hid the change. A frozen weight (a LoRA base) needs no input at all:
# nothing is saved for it - so whether this all-gather runs follows the weight's requires_grad,
# which must then be alike on every TP rank (a weight frozen on some ranks only was already a
# model whose replicas drift; now its backward waits for the peers' gather). A region's column
# layers (q, k and v) share one gather: the first whose backward runs gathers, the others take
# its result (comm.RegatheredInput), which the entry drops in its own backward, after all of
# theirs - one all-gather per region in backward, as Megatron's fused QKV has.
def _saved_input(ctx, weight_grad: bool, x: Tensor, x_full: Tensor, group, input_comm: str,
                 seq_dim: int) -> Tensor | None:
    """What a column layer saves for its weight gradient (Note [re-gathering the sequence in
    backward]), setting ctx.regather: (group, dim) to gather it with in backward, or None."""
    ctx.regather, ctx.x_shape = None, x_full.shape
    if not weight_grad:
        return None
    if input_comm == "sequence":
        ctx.regather = (group, seq_dim, None)
        return x
    tag = getattr(x, "_pl_sp_chunk", None)
    if tag is not None and tag[1] is group and (tag[0]._version, x._version) == tag[4:]:
        ctx.regather = tag[1:4]
        return tag[0]
    return x_full


def _start_input(ctx, saved: Tensor | None):
    """The layer's whole input for its weight gradient: a function that returns it, its
    all-gather launched now when the chunk was saved - or the one another column layer of the
    region gathered (comm.RegatheredInput)."""
    if saved is None or ctx.regather is None:
        return lambda: saved
    group, dim, shared = ctx.regather
    if shared is not None and shared.tensor is not None:
        return lambda: shared.tensor
    pending = comm.all_gather(saved, dim, group, async_op=True)
    if shared is None:
        return pending

    def gathered() -> Tensor:
        shared.tensor = pending()
        return shared.tensor
    return gathered


class _ColumnLinear(torch.autograd.Function):
    """y = act(gather_sp(x) @ W^T + b); backward overlaps the grad-input collective with dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, approximate, group, input_comm, seq_dim):
        # input_comm: "all_reduce" (replicated input), "sequence" (gather the sequence here,
        # reduce-scatter the input gradient) or "none" (the region's entry does it, Note [one
        # reduction per region]; gradient left partial)
        x_full = comm.all_gather(x, seq_dim, group) if input_comm == "sequence" else x
        needs_grad = any(ctx.needs_input_grad[:3])
        if approximate is None:
            y, preact = linear_forward(x_full, weight, bias), None
        else:
            y, preact = linear_gelu_forward(x_full, weight, bias, approximate, needs_grad)
        if needs_grad:
            saved = _saved_input(ctx, ctx.needs_input_grad[1], x, x_full, group, input_comm, seq_dim)
            ctx.save_for_backward(saved, weight, preact)
        ctx.approximate, ctx.group, ctx.input_comm, ctx.seq_dim = approximate, group, input_comm, seq_dim
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, weight, preact = ctx.saved_tensors
        x_full = _start_input(ctx, saved)  # Note [re-gathering the sequence in backward]
        n, k = weight.shape
        if ctx.approximate is None:
            dz, db = dy, (dy.reshape(-1, n).sum(0) if ctx.has_bias else None)
        else:
            dz, db = bias_gelu_backward(dy, preact, ctx.approximate)
        dz2 = dz.reshape(-1, n)
        dx, handle = _input_grad(ctx, dz2, weight, ctx.x_shape) if ctx.needs_input_grad[0] else (None, None)
        dw = linear_weight_grad(dz2, x_full().reshape(-1, k)) if ctx.needs_input_grad[1] else None
        db = db if ctx.has_bias and ctx.needs_input_grad[2] else None
        _wait_input_grad(ctx, handle)
        return dx, dw, db, None, None, None, None


def _input_comm(layer: "ColumnParallelLinear") -> str:
    """The collective a column layer does on its input, _ColumnLinear's input_comm."""
    if layer.shared_input:  # the region's entry does it (Note [one reduction per region])
        return "none"
    if layer.sequence_parallel and comm.group_size(layer.tp_group) > 1 and not comm.whole_sequence():
        return "sequence"
    return "all_reduce"


def _input_grad(ctx, dz2: Tensor, weight: Tensor, x_shape) -> tuple[Tensor, object]:
    """dx = dz @ W, and its collective launched asynchronously (input_comm "sequence":
    reduce-scatter; "all_reduce"; "none": left partial), to overlap the weight-gradient GEMM."""
    dx, handle = linear_input_grad(dz2, weight).view(x_shape), None
    if comm.group_size(ctx.group) > 1:
        if ctx.input_comm == "sequence":
            dx, handle = comm.reduce_scatter(dx, ctx.group, async_op=True, dim=ctx.seq_dim)
        elif ctx.input_comm == "all_reduce":
            handle = comm.all_reduce(dx, ctx.group, async_op=True)
    return dx, handle


def _wait_input_grad(ctx, handle) -> None:
    fault.wait(handle, "ColumnParallelLinear backward " + ("reduce_scatter" if ctx.input_comm == "sequence" else
                                                              "all_reduce"), ctx.group)


def _rows_packed(a: Tensor, b: Tensor | None) -> Tensor:
    """[a; b] along dim 0: a view when b's rows directly follow a's in one storage (the layout
    SwiGLUMLP.pack_ gives gate and up), else a copy; `a` itself when b is None (a is packed)."""
    if b is None:
        return a
    if _adjacent(a, b):
        return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride(), a.storage_offset())
    return torch.cat([a, b])


def _adjacent(a: Tensor, b: Tensor) -> bool:
    """Whether b's elements directly follow a's in one storage (both contiguous, same dtype)."""
    return (a.dtype == b.dtype and a.device == b.device and a.is_contiguous() and b.is_contiguous()
            and a.shape[1:] == b.shape[1:] and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


class _ColumnSwiGLU(torch.autograd.Function):
    """y = silu(x Wg^T + bg) * (x Wu^T + bu) from one GEMM on [Wg; Wu] (linear_swiglu), with the
    column layer's collectives (_ColumnLinear). Gate and up stay two parameters (their names,
    their shards); the packed weight is a view of them when they are adjacent in memory, else
    a copy made in forward and again in backward: only the parameters are saved, so under
    ZeRO-3 the gathered weights are freed after forward and gathered again for backward, as
    for any layer. w_up (and b_up) None: w_gate is the packed [Wg; Wu] itself (one parameter,
    PackedSwiGLUMLP), whose gradient is returned whole."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up, group, input_comm, seq_dim):
        x_full = comm.all_gather(x, seq_dim, group) if input_comm == "sequence" else x
        needs_grad = any(ctx.needs_input_grad[:5])
        bias = _rows_packed(b_gate, b_up) if b_gate is not None else None
        y, preact = linear_swiglu_forward(x_full, _rows_packed(w_gate, w_up), bias, needs_grad)
        if needs_grad:
            ctx.weight_grad = any(ctx.needs_input_grad[1:3])  # gate's or up's
            saved = _saved_input(ctx, ctx.weight_grad, x, x_full, group, input_comm, seq_dim)
            ctx.save_for_backward(saved, w_gate, w_up, preact)
        ctx.group, ctx.input_comm, ctx.seq_dim, ctx.has_bias = group, input_comm, seq_dim, b_gate is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, w_gate, w_up, preact = ctx.saved_tensors
        x_full = _start_input(ctx, saved)  # Note [re-gathering the sequence in backward]
        packed = w_up is None
        n, k = w_gate.shape[0] // (2 if packed else 1), w_gate.shape[1]
        dz, db = swiglu_backward(dy, preact, ctx.has_bias and any(ctx.needs_input_grad[3:5]))
        dz2 = dz.reshape(-1, 2 * n)
        dx, handle = (_input_grad(ctx, dz2, _rows_packed(w_gate, w_up), ctx.x_shape) if ctx.needs_input_grad[0]
                      else (None, None))
        dw = linear_weight_grad(dz2, x_full().reshape(-1, k)) if ctx.weight_grad else None
        db = db if ctx.has_bias and any(ctx.needs_input_grad[3:5]) else None
        _wait_input_grad(ctx, handle)
        if packed:
            return dx, dw, None, db, None, None, None, None
        return (dx, dw[:n] if dw is not None else None, dw[n:] if dw is not None else None,
                db[:n] if db is not None else None, db[n:] if db is not None else None, None, None, None)


class _RowLinear(torch.autograd.Function):
    """y = reduce(x @ W^T) over the TP group (SP: reduce-scatter on seq_dim), + bias after the
    reduction, added in place to the collective's fresh output."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim):
        partial = linear_forward(x, weight, None)
        if comm.group_size(group) > 1:
            if sequence_parallel:
                partial, _ = comm.reduce_scatter(partial, group, dim=seq_dim)
            else:
                comm.all_reduce(partial, group)
        if bias is not None:
            partial.add_(bias)
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.seq_dim = group, sequence_parallel, seq_dim
        return partial

    @staticmethod
    def backward(ctx, dy):
        # Under SP this rank's bias gradient covers its own rows only; the parameter's hook
        # (reduce_grad_over_tp) sums it over the group.
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        if not any(ctx.needs_input_grad[:2]):  # only the bias trains: nothing was saved
            return None, None, db, None, None, None
        x, weight = ctx.saved_tensors
        d = comm.all_gather(dy, ctx.seq_dim, ctx.group) if ctx.sequence_parallel else dy
        d2 = d.reshape(-1, weight.shape[0])
        dx = linear_input_grad(d2, weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = linear_weight_grad(d2, x.reshape(-1, weight.shape[1])) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None, None, None


def _check_seq_dim(seq_dim, layer: str) -> None:
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise TypeError(f"{layer}: seq_dim must be an int (0 for [seq, batch, hidden], 1 for [batch, seq, hidden]), "
                        f"got {seq_dim!r}")


def _check_input(x: Tensor, expected: int, layer: str, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{layer}: input of shape {tuple(x.shape)} has last dim "
                         f"{x.shape[-1] if x.dim() else None}, expected {what} = {expected}")


class _LinearConversions:
    """from_linear / to_linear, shared by both layer kinds."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs):
        """Shard an existing nn.Linear (its weights are copied, nothing is re-initialised)."""
        full = (linear.weight.detach(), linear.bias.detach() if linear.bias is not None else None)
        return keep_requires_grad(cls(linear.in_features, linear.out_features, linear.bias is not None, _full=full,
                                      **kwargs), linear)

    def to_linear(self) -> nn.Linear:
        """The gathered nn.Linear (a collective: every rank of the TP group must call it)."""
        weight = gather_full(self.weight, self.tp_group)
        bias = gather_full(self.bias, self.tp_group) if self.bias is not None else None
        out = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=weight.device,
                        dtype=weight.dtype)
        with torch.no_grad():
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
        return out


class ColumnParallelLinear(_LinearConversions, nn.Module):
    """Linear layer with its output features split over the TP group (see the module doc).

    `fused_sizes` describes a fused weight (e.g. QKV: (q, k, v) sizes summing to
    out_features): each logical sub-matrix is split on its own, so rank r's output is
    [q_r, k_r, v_r].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
                 activation: str | None = None, sequence_parallel: bool = False, seq_dim: int = 0,
                 shared_input: bool = False, tp_group: dist.ProcessGroup | None = None, device=None, dtype=None,
                 init_method: Callable[[Tensor], None] | None = None, fused_sizes: tuple[int, ...] | None = None,
                 _full: tuple[Tensor, Tensor | None] | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True is not supported: under sequence "
                             "parallelism the column output feeds a RowParallelLinear")
        if not isinstance(shared_input, bool):
            raise TypeError(f"ColumnParallelLinear: shared_input must be True or False, got {shared_input!r}")
        _check_seq_dim(seq_dim, "ColumnParallelLinear")
        check_size(in_features, "ColumnParallelLinear in_features")
        check_size(out_features, "ColumnParallelLinear out_features")
        tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        for size in fused_sizes or (out_features,):
            check_divisible(size, tp, "ColumnParallelLinear out_features" if fused_sizes is None
                            else f"ColumnParallelLinear fused block of size {size} (fused_sizes={fused_sizes})")
        if fused_sizes is not None and sum(fused_sizes) != out_features:
            raise ValueError(f"fused_sizes {fused_sizes} sum to {sum(fused_sizes)}, not out_features {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.seq_dim, self.shared_input = seq_dim, shared_input
        self.activation, self.tp_group, self.fused_sizes = activation, tp_group, fused_sizes
        weight, b = _full if _full is not None else _init_full(out_features, in_features, bias, device, dtype,
                                                                init_method)
        self.weight = sharded_parameter(weight, 0, tp, rank, fused_sizes)
        self.bias = sharded_parameter(b, 0, tp, rank, fused_sizes) if b is not None else None

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.in_features, "ColumnParallelLinear", "in_features")
        x, weight, bias = linear_autocast_inputs(x, self.weight, self.bias)
        y = _ColumnLinear.apply(x, weight, bias, _ACTIVATIONS[self.activation], self.tp_group, _input_comm(self),
                                self.seq_dim % x.dim())
        return comm.gather_from_tp(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        tp = comm.group_size(self.tp_group)
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
                f"tp={tp}, bias={self.bias is not None}, activation={self.activation}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
                + (f", seq_dim={self.seq_dim}" if self.sequence_parallel else "")
                + (", shared_input=True" if self.shared_input else ""))


class RowParallelLinear(_LinearConversions, nn.Module):
    """Linear layer with its input features split over the TP group (see the module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, seq_dim: int = 0, tp_group: dist.ProcessGroup | None = None,
                 device=None, dtype=None, init_method: Callable[[Tensor], None] | None = None,
                 _full: tuple[Tensor, Tensor | None] | None = None):
        super().__init__()
        _check_seq_dim(seq_dim, "RowParallelLinear")
        check_size(in_features, "RowParallelLinear in_features")
        check_size(out_features, "RowParallelLinear out_features")
        tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        check_divisible(in_features, tp, "RowParallelLinear in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.tp_group = input_is_parallel, sequence_parallel, tp_group
        self.seq_dim = seq_dim
        weight, b = _full if _full is not None else _init_full(out_features, in_features, bias, device, dtype,
                                                                init_method)
        self.weight = sharded_parameter(weight, 1, tp, rank)
        self.bias = nn.Parameter(b.detach().clone()) if b is not None else None  # replicated
        if self.bias is not None and sequence_parallel:
            reduce_grad_over_tp(self.bias, tp_group)

    def forward(self, x: Tensor) -> Tensor:
        tp = comm.group_size(self.tp_group)
        if self.input_is_parallel:
            _check_input(x, self.in_features // tp, "RowParallelLinear", f"in_features / tp = {self.in_features} / {tp}")
        else:
            _check_input(x, self.in_features, "RowParallelLinear", "in_features")
            x = comm.scatter_to_tp(x, self.tp_group)
        x, weight, bias = linear_autocast_inputs(x, self.weight, self.bias)
        # Note [a forward without the sequence split] in comm.py: an all-reduce then
        return _RowLinear.apply(x, weight, bias, self.tp_group, self.sequence_parallel and tp > 1
                                and not comm.whole_sequence(), self.seq_dim % x.dim())

    def extra_repr(self) -> str:
        tp = comm.group_size(self.tp_group)
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"tp={tp}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", seq_dim={self.seq_dim}" if self.sequence_parallel else ""))


def has_hooks(module: nn.Module) -> bool:
    """Does `module` carry hooks of its own (forward, backward, pre)? The fused MLPs then call
    their projections as modules (Note [hooks on fused parts]). torch's global module hooks
    are not counted: the observers that register them (FlopCounterMode's and CommDebugMode's
    ModuleTracker) see every module called, and counting them turned fusion off for good when a
    model was parallelized under one (review finding)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


# Note [hooks on fused parts]: the fused MLPs read their gate and up projections' weights and
# run one GEMM, so the projections' own forward never runs, nor any hook on them: a hook the user
# put on mlp.gate_proj (to record activations, say) silently never fired, and ZeRO-3 wrapping
# each nn.Linear as a unit (its gather is a pre-hook) failed at the first forward (review
# finding). So a fused MLP whose projections carry hooks when it is called - registered before
# or after the swap, by the user or a wrapper - runs them as modules,
# `down_proj(silu(gate_proj(x)) * up_proj(x))`: the same values, unfused, with their hooks. A
# few dict reads a call, for the fused path in the common case. (fuse() leaves a module that has
# hooks of its own unswapped, and the fused decoder layer adds the residual apart from a
# post-attention norm with hooks, whose hook would otherwise see a tuple: parallel_layers/fused.py.)
class SwiGLUMLP(nn.Module):
    """A SwiGLU MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))` (Llama, Qwen2, Mistral), whose
    gate and up projections run as one GEMM with the activation fused (linear_swiglu).

    It holds the MLP's own three modules under their names, so state dicts, checkpoints and
    exports are unchanged: gate_proj / up_proj both ColumnParallelLinear (matching shards: rank
    r's output is [gate_r, up_r]) or both nn.Linear; down_proj the RowParallelLinear or
    nn.Linear that follows. `pack_()` puts the gate and up weights (and biases) in one
    allocation, gate rows then up rows, so the packed weight the GEMM reads is a view of the
    two parameters; ZeRO-3 keeps them in one allocation when both are in one group (Note
    [storage shared within a group] in zero/_param.py), else copies them per call.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        kinds = (type(gate_proj), type(up_proj))
        if kinds not in ((ColumnParallelLinear, ColumnParallelLinear), (nn.Linear, nn.Linear)):
            raise TypeError(f"SwiGLUMLP: gate_proj and up_proj must both be ColumnParallelLinear or both nn.Linear, "
                            f"got {kinds[0].__name__} and {kinds[1].__name__}")
        if gate_proj.weight.shape != up_proj.weight.shape or (gate_proj.bias is None) != (up_proj.bias is None):
            raise ValueError(f"SwiGLUMLP: gate_proj and up_proj must match: weights {tuple(gate_proj.weight.shape)} "
                             f"and {tuple(up_proj.weight.shape)}, bias {gate_proj.bias is not None} and "
                             f"{up_proj.bias is not None}")
        if isinstance(gate_proj, ColumnParallelLinear):
            settings = ("tp_group", "sequence_parallel", "seq_dim", "shared_input", "gather_output", "activation")
            differ = [a for a in settings if getattr(gate_proj, a) != getattr(up_proj, a)]
            if differ or gate_proj.gather_output or gate_proj.activation or gate_proj.fused_sizes:
                raise ValueError(f"SwiGLUMLP: gate_proj and up_proj must be plain column layers with the same "
                                 f"settings (differing: {differ}; gather_output={gate_proj.gather_output}, "
                                 f"activation={gate_proj.activation}, fused_sizes={gate_proj.fused_sizes})")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.pack_()

    def pack_(self) -> None:
        """Gate and up weights (and biases) into one allocation each, in place: the parameters
        keep their identity (optimizer, hooks, attributes), their values and names. A no-op on
        the meta device (meta.materialize packs them when it gives them storage)."""
        for name in ("weight", "bias"):
            gate, up = getattr(self.gate_proj, name), getattr(self.up_proj, name)
            if gate is None or gate.is_meta or _adjacent(gate, up):
                continue
            packed = torch.cat([gate.detach(), up.detach()])
            with torch.no_grad():
                gate.data, up.data = packed[:gate.shape[0]], packed[gate.shape[0]:]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj, self.up_proj
        if has_hooks(gate) or has_hooks(up):  # Note [hooks on fused parts]
            return self.down_proj(nn.functional.silu(gate(x)) * up(x))
        group, input_comm, seq_dim = _column_comm(gate, x, "SwiGLUMLP gate_proj/up_proj")
        xc, w_gate, b_gate = linear_autocast_inputs(x, gate.weight, gate.bias)
        _, w_up, b_up = linear_autocast_inputs(x, up.weight, up.bias)
        return self.down_proj(_ColumnSwiGLU.apply(xc, w_gate, w_up, b_gate, b_up, group, input_comm, seq_dim))


def _column_comm(layer: nn.Module, x: Tensor, what: str) -> tuple:
    """(group, input collective, sequence dim) of a fused MLP's column layer, as
    ColumnParallelLinear.forward decides them; a plain nn.Linear has no collective at all."""
    if not isinstance(layer, ColumnParallelLinear):
        return None, "none", 0
    _check_input(x, layer.in_features, what, "in_features")
    return layer.tp_group, _input_comm(layer), layer.seq_dim % x.dim()


class PackedSwiGLUMLP(nn.Module):
    """A SwiGLU MLP whose gate and up projections are one packed layer, `[gate; up]` rows, as
    Phi-3, GLM and GLM-4 write it: `gate, up = gate_up_proj(x).chunk(2, -1);
    down_proj(up * silu(gate))`, run as one GEMM with the activation fused (linear_swiglu).

    It holds the MLP's own two modules under their names (state dicts, checkpoints and exports
    unchanged): gate_up_proj a ColumnParallelLinear whose two blocks are split on their own
    (fused_sizes (I, I): rank r's rows are [gate_r; up_r], the local packed layout) with
    down_proj the RowParallelLinear after it, or both nn.Linear. `up * silu(gate)` and
    `silu(gate) * up` are the same IEEE product."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        if isinstance(gate_up_proj, ColumnParallelLinear):
            half = gate_up_proj.out_features // 2
            if (gate_up_proj.fused_sizes != (half, half) or gate_up_proj.gather_output or gate_up_proj.activation
                    or not isinstance(down_proj, RowParallelLinear)):
                raise ValueError(f"PackedSwiGLUMLP: gate_up_proj must be a column layer of two equal blocks split on "
                                 f"their own (fused_sizes=({half}, {half})) before a RowParallelLinear; got "
                                 f"fused_sizes={gate_up_proj.fused_sizes}, gather_output={gate_up_proj.gather_output}, "
                                 f"activation={gate_up_proj.activation}, down_proj {type(down_proj).__name__}")
        elif not (isinstance(gate_up_proj, nn.Linear) and isinstance(down_proj, nn.Linear)
                  and gate_up_proj.out_features % 2 == 0):
            raise TypeError(f"PackedSwiGLUMLP: gate_up_proj and down_proj must be a ColumnParallelLinear and a "
                            f"RowParallelLinear, or two nn.Linear (an even number of packed rows); got "
                            f"{type(gate_up_proj).__name__} and {type(down_proj).__name__}")
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, x: Tensor) -> Tensor:
        layer = self.gate_up_proj
        if has_hooks(layer):  # Note [hooks on fused parts]
            gate, up = layer(x).chunk(2, dim=-1)
            return self.down_proj(up * nn.functional.silu(gate))
        group, input_comm, seq_dim = _column_comm(layer, x, "PackedSwiGLUMLP gate_up_proj")
        xc, w, b = linear_autocast_inputs(x, layer.weight, layer.bias)
        return self.down_proj(_ColumnSwiGLU.apply(xc, w, None, b, None, group, input_comm, seq_dim))
