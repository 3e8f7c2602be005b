"""Tensor parallelism for a mixture-of-experts layer whose experts are stacked 3-D parameters,
as transformers 5 holds them (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3, ...):

    experts.gate_up_proj  [num_experts, 2 * intermediate, hidden]   [gate; up] packed on dim 1
    experts.down_proj     [num_experts, hidden, intermediate]

Note [experts split like their MLP]: every expert is a SwiGLU MLP, and is split the way
Megatron splits one: rank r holds rows [r * I / tp, (r + 1) * I / tp) of each expert's gate
and of its up projection (dim 1, each packed block split on its own, so the local
`chunk(2, dim=-1)` of transformers' forward still yields matching gate and up halves) and
the same columns of its down projection (dim 2). Each rank then computes, for every token
its router sends to an expert, that expert's partial output over this rank's intermediate
features; the module's output - the routing-weighted sum of the experts' outputs - is a
partial sum, all-reduced once in the forward (as a row layer's output). In the backward, the
gradients of the module's inputs are partial sums too: the hidden states' (each rank back-
propagates through its features only) and the routing weights' (each rank's partial output
times the output gradient); both are all-reduced (copy_to_tp on every floating input), and
the router before them, replicated, gets the whole gradient on every rank, so it stays in
sync without a sum of its own. Routing is the same on every rank because its input is: the
residual stream is replicated, bitwise, by the all-reduces that produce it.

This is transformers' published "moe_tp_experts" style (with "packed_colwise" for
gate_up_proj and "rowwise" for down_proj), and what its own tp_plan="auto" does.

Note [whole experts per rank]: Experts(split="experts") instead gives each rank of the TP
group num_experts / tp whole experts (both parameters cut on dim 0): what suits many small
experts (Qwen3-MoE's 128 of 768 features, where an intermediate split leaves each rank GEMMs
of 384 / tp columns). Every rank still sees every token (the input is replicated over TP, as
for any TP region), so no all-to-all is needed: the expert ids the router picked are renumbered
to this rank's experts, and ids of other ranks' experts become the sentinel `num_experts`
(local), which transformers' expert kernels skip - the eager loop, grouped_mm and batched_mm
alike, as its own expert parallelism relies on (with `_is_expert_parallel` set, grouped_mm
and batched_mm also zero the sentinel rows their GEMMs leave uninitialised). The output is this rank's experts' share of the
routing-weighted sum, all-reduced as above; the routing weights of the skipped entries get no
gradient here and theirs on the rank that holds the expert, so their gradient is again a sum
over ranks. Each rank's work is the tokens routed to its experts: balanced only as far as the
routing is. A rank whose experts get no token at all computes nothing from its inputs
(transformers' eager kernel returns zeros it never connects to them), and its backward would
then skip the input-gradient all-reduces its peers run - a mismatched collective. So the output
is joined to every floating input by `JoinedToInputs` (identity forward, zero gradients
backward), and every rank reaches those all-reduces; and to the expert weights (a zero
gradient), which the plain model's stacked experts always get - zero rows for an expert no
token reached - so that an optimizer's weight decay or step count treats them alike. True expert parallelism - experts spread over data-parallel ranks, each with its own
tokens, exchanged by all-to-all - is not this.

The module keeps its class's forward (and transformers' expert kernels, chosen by
`config._experts_implementation`): it becomes an instance of TensorParallel<Name>(<Name>),
whose forward wraps the original one with the two collectives.

Under sequence parallelism (hf_sequence_parallel.py, Note [experts under sequence
parallelism] there) the module issues no collective: the MoE block around it gathers the
sequence at its entry and reduce-scatters the block's output, and the routing weights'
gradient stays a partial sum, which the router turns into partial sums of its own.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch import Tensor

from parallel_layers.parallel_dims import divisors
from parallel_layers.tensor_parallel import comm
from parallel_layers.tensor_parallel.sharding import sharded_parameter


@dataclasses.dataclass(frozen=True)
class Experts:
    """A module holding every expert's weights as 3-D parameters: `column` [experts,
    packed * intermediate, hidden] ([gate; up] packed on dim 1) and `row` [experts, hidden,
    intermediate]; each expert split as a SwiGLU MLP is (Note [experts split like their MLP])."""

    column: str = "gate_up_proj"
    row: str = "down_proj"
    packed: int = 2
    split: str = "intermediate"  # or "experts": whole experts per rank (Note [whole experts per rank])

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"Experts(split={self.split!r}): split must be one of {list(SPLITS)} (each expert's "
                             "intermediate features over the ranks, or whole experts per rank)")


SPLITS = ("intermediate", "experts")


def layout_problem(module: nn.Module, spec: Experts, tp: int) -> str | None:
    """Why `module` cannot be split as `spec` over tp ranks; None if it can."""
    params = dict(module.named_parameters())
    names = sorted(params)
    if is_tensor_parallel_experts(module) or any(hasattr(p, "tp_shard") for p in params.values()):
        return f"{type(module).__name__} is split over tensor-parallel ranks already (parallelize ran on it)"
    if sorted((spec.column, spec.row)) != names:
        return (f"{type(module).__name__} holds parameters {names}; Experts() splits a module holding exactly "
                f"{spec.column!r} [experts, {spec.packed} * intermediate, hidden] and {spec.row!r} [experts, hidden, "
                "intermediate] (biases and other layouts are not supported)")
    # what transformers' @use_experts_implementation says of the layout
    flags = {"is_transposed": False, "has_bias": False, "has_post_expert_norm": False, "has_gate": True,
             "is_concatenated": True}
    other = {k: getattr(module, k) for k, v in flags.items() if getattr(module, k, v) is not v}
    if other:
        return (f"{type(module).__name__} has {other}; Experts() supports {flags}: [experts, out, in] weights "
                "without biases, gate and up concatenated")
    column, row = params[spec.column], params[spec.row]
    if column.dim() != 3 or row.dim() != 3 or column.shape[1] % spec.packed:
        return (f"{type(module).__name__}.{spec.column} is {tuple(column.shape)} and .{spec.row} is "
                f"{tuple(row.shape)}; Experts() needs [experts, {spec.packed} * intermediate, hidden] and "
                "[experts, hidden, intermediate]")
    inter = column.shape[1] // spec.packed
    if tuple(row.shape) != (column.shape[0], column.shape[2], inter):
        return (f"{type(module).__name__}.{spec.row} is {tuple(row.shape)}, but {spec.column} "
                f"{tuple(column.shape)} needs it {(column.shape[0], column.shape[2], inter)}")
    if spec.split == "experts":
        if column.shape[0] % tp or getattr(module, "num_experts", None) != column.shape[0]:
            return (f"{type(module).__name__} has {column.shape[0]} experts (num_experts = "
                    f"{getattr(module, 'num_experts', None)!r}); Experts(split='experts') needs num_experts to match and "
                    f"to divide by tp={tp}; valid tensor-parallel sizes for it are {divisors(column.shape[0], 64)}")
        return None
    if inter % tp:
        return (f"{type(module).__name__} has intermediate size {inter} per expert, which does not divide by "
                f"tp={tp}; valid tensor-parallel sizes for it are {divisors(inter, 64)}")
    return None


_TP_CLASSES: dict[type, type] = {}


def convert(module: nn.Module, spec: Experts, tp_group, sequence_parallel: bool = False) -> None:
    """Shard `module`'s expert weights in place and wrap its forward with the collectives
    (Note [experts split like their MLP]; with sequence_parallel, none: the block around it
    communicates); `layout_problem` must have passed."""
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    column, row = getattr(module, spec.column), getattr(module, spec.row)
    inter = column.shape[1] // spec.packed
    if spec.split == "experts":  # Note [whole experts per rank]
        local = column.shape[0] // tp
        setattr(module, spec.column, sharded_parameter(column.detach(), 0, tp, rank)
                .requires_grad_(column.requires_grad))
        setattr(module, spec.row, sharded_parameter(row.detach(), 0, tp, rank).requires_grad_(row.requires_grad))
        module.num_experts, module.expert_offset = local, rank * local
        # transformers' grouped_mm and batched_mm kernels mask the sentinel rows (which they leave
        # uninitialised, NaN possibly) only when told the experts are split this way
        module._is_expert_parallel = True
    else:
        setattr(module, spec.column, sharded_parameter(column.detach(), 1, tp, rank, fused=(inter,) * spec.packed)
                .requires_grad_(column.requires_grad))
        setattr(module, spec.row, sharded_parameter(row.detach(), 2, tp, rank).requires_grad_(row.requires_grad))
        module.expert_offset = None
        if isinstance(getattr(module, "intermediate_dim", None), int):  # per-rank bookkeeping, as num_heads
            module.intermediate_dim = inter // tp
    cls = type(module)
    if cls not in _TP_CLASSES:
        own_forward = cls.forward

        def forward(self, *args, **kwargs):
            group = self.tp_group
            if self.expert_offset is not None:  # the router's expert ids, renumbered to this rank's experts
                args = tuple(_local_ids(a, self.expert_offset, self.num_experts) for a in args)
                kwargs = {k: _local_ids(v, self.expert_offset, self.num_experts) for k, v in kwargs.items()}
            if not self.sequence_parallel:
                args = tuple(comm.copy_to_tp(a, group) if _floating(a) else a for a in args)
                kwargs = {k: comm.copy_to_tp(v, group) if _floating(v) else v for k, v in kwargs.items()}
            out = own_forward(self, *args, **kwargs)
            if self.expert_offset is not None and torch.is_grad_enabled():  # idle experts (see the Note)
                joined = [a for a in (*args, *kwargs.values()) if _floating(a) and a.requires_grad]
                out = JoinedToInputs.apply(out, *joined, *unreached_weights(self, out))
            # under sequence parallelism a partial sum, reduce-scattered by the block's hook
            return out if self.sequence_parallel else comm.reduce_from_tp(out, group)

        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,), {"forward": forward})
    module.__class__ = _TP_CLASSES[cls]
    module.tp_group, module.sequence_parallel = tp_group, sequence_parallel


def is_tensor_parallel_experts(module: nn.Module) -> bool:
    return type(module) in _TP_CLASSES.values()


class JoinedToInputs(torch.autograd.Function):
    """`out` as it is, with an autograd edge to each of `inputs` (a zero gradient): so that the
    backward reaches them on every rank (Note [whole experts per rank])."""

    @staticmethod
    def forward(ctx, out, *inputs):
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in inputs]
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.inputs))


def unreached_weights(module: nn.Module, out: Tensor) -> list[nn.Parameter]:
    """The expert weights of `module` needing a gradient when its output `out` was computed
    from none of them (no token reached any of its experts: transformers' eager kernel returns
    zeros connected to nothing), else []. In the plain model every expert is a row of one
    stacked weight, whose gradient always exists (zero rows for an unreached expert), so a rank
    holding some of the experts must give its weights one too (`JoinedToInputs`)."""
    if out.requires_grad:
        return []
    spec = Experts()
    return [w for w in (getattr(module, spec.column), getattr(module, spec.row)) if w.requires_grad]


def _local_ids(x, offset: int, count: int):
    """Expert ids (an integer tensor) as this rank's: offset..offset + count - 1 -> 0..count - 1,
    any other -> count, the sentinel transformers' expert kernels skip (Note [whole experts per
    rank]); anything else as it is."""
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dtype == torch.bool:
        return x
    local = x - offset
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
