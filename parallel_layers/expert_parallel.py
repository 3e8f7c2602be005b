"""Expert parallelism: a mixture of experts' experts spread over the data-parallel ranks, each
rank's tokens sent to the rank that holds their expert and back by all-to-all.

    par = parallelize(model, init_parallel(dp=4), ..., expert_parallel=True, zero_stage=1)
    par = parallelize(model, init_parallel(dp=16), ..., expert_parallel=8, zero_stage=3)

Note [experts over the data-parallel ranks]: over ep ranks (all of dp for expert_parallel=True),
the rank of expert-parallel rank r holds experts [r * E / ep, (r + 1) * E / ep) of every MoE
layer (both stacked parameters cut on dim 0) and no others; everything else stays replicated
over dp as usual. Unlike tensor parallelism
(tensor_parallel/experts.py), each rank has its own tokens, so a MoE layer's experts module
(transformers' `<Family>Experts`, called with the hidden states [tokens, hidden] and the
router's top-k expert ids and weights [tokens, k]) becomes:

  1. dispatch: the (token, slot) pairs sorted by expert id (stable), the counts per expert
     exchanged (one all-to-all of E int64s: what each rank will receive from each other rank
     for each of its experts, which sizes the next one - one host synchronisation per layer,
     as in Megatron's dropless dispatcher), the pairs' hidden states sent by all-to-all to
     the ranks of their experts;
  2. the received rows, ordered by source rank then by local expert, run through the module's
     own forward and transformers' expert kernel (eager, grouped_mm or batched_mm) as top-1
     with weight 1 on this rank's E / ep experts (ids renumbered);
  3. combine: the outputs go back by the reverse all-to-all, unsorted to the (token, slot)
     pairs, weighted by the routing weights and summed over the k slots, on the token's rank.

The backward runs the two all-to-alls in reverse (the gradients of the sent rows come back to
the rank that sent them), and the routing weights' gradient is computed where they are used,
on the token's own rank: the router needs nothing. A rank whose experts receive no row still
runs both all-to-alls in the backward (its output is joined to the received rows), and its
weights get a zero gradient, as the plain model's stacked experts do (`unreached_weights`).

Gradients. A replicated parameter's gradient is averaged over dp by the data-parallel wrapper
(the sum of the ranks' gradients, divided by dp). An expert's weight gradient already holds
the sum over the tokens of every rank of its expert-parallel group that reached it - the
all-to-all did the summing - so a hook divides it by ep as the gradient arrives, and the wrapper
averages it over its replica group only (Note [expert replicas]): (sum over the dp / ep groups of
each group's sum / ep) / (dp / ep) is the sum over all dp ranks / dp, the others' average. With ep
= dp the replica group is this rank alone: DataParallel neither broadcasts nor averages them,
ZeRO's groups of them issue no collective. ZeRO keeps them whole at every stage (no gather
hooks, which would run again in an activation-checkpointing recompute), so its optimizer and
checkpoints take them like any other; `clip_grad_norm_` sums their squares over the
expert-parallel group (each rank's are other experts'). The all-to-alls run on a process group
of their own (`expert_groups`): the wrappers' gradient reductions are issued asynchronously on
the data-parallel group during the backward, and NCCL requires the collectives of one group to
be issued in the same order on every rank.

Note [expert replicas]: with ep < dp (expert_parallel=ep, a divisor of dp), the dp ranks form dp
/ ep expert-parallel groups of ep consecutive ranks (consecutive: with tp innermost in the mesh,
ep * tp consecutive global ranks, within a node as long as ep * tp GPUs fit in one, where the
all-to-alls are cheapest), and each group holds every expert once. Dp rank d is expert-parallel
rank d % ep of group d // ep; the ranks with the same d % ep hold the same experts and form its
replica group (dp / ep ranks, strided). Tokens never leave their expert-parallel group. Under
DataParallel the experts are broadcast from the replica group's first rank and averaged over it
in buckets of their own (data_parallel.py); under ZeRO each MoE layer's experts form a group over
the replica group: at every stage held whole (E / ep experts per rank), their gradients
reduce-scattered over the replicas and their optimizer state sharded over them (ZeRO-1 for the
experts, as Megatron's distributed optimizer shards theirs; torchtitan shards them further with
FSDP), the full parameters all-gathered after each step. Both reduce them at the end of
backward, not as their gradients arrive: when they arrive depends on the routing (where no
token reached a rank's experts, transformers' eager kernel computes nothing from their weights,
and their zero gradient comes at another point of the backward), so it differs between
replicas, and ranks waiting for a replica's
reduction mid-backward while their expert-parallel partners wait for them in the next
all-to-all hang (Note [expert groups] in zero/_hooks.py). The cost: that reduction is not
overlapped with backward. This lets a model with fewer experts than dp ranks (Mixtral's 8 at
dp=16) use expert parallelism, and keeps the all-to-alls inside a node. Every rank creates
every expert-parallel and every replica group (`new_subgroups_by_enumeration`; with ep = dp
that is dp one-rank groups, but a rank only builds the groups it is in: 17 ms for 1024 ranks
on the fake process group).

Checkpoints, `hf.load_pretrained` and `hf.save_pretrained` see each rank's experts as rows
[offset, offset + E / ep) of the logical stacked tensor (its placement layout), so a
checkpoint saved with expert parallelism loads into any other layout and back.

With tensor parallelism too (tp > 1; Megatron's expert tensor parallelism): the plan's
Experts() first splits every expert over the TP group as its MLP, then this rank keeps its
expert-parallel rank's experts of those shards (the placement boxes cut on dim 0: `placement.narrowed`).
The ranks of one TP group hold the same tokens and routing (the residual stream is
replicated over tp), so the all-to-alls, one group per TP coordinate, hand each of them the
same rows; the tensor-parallel forward inside (tensor_parallel/experts.py) computes each
expert's partial output over this rank's intermediate features and all-reduces it over tp
(under sequence parallelism the MoE block's reduce-scatter does), and all-reduces the rows'
gradient in the backward. The new parameters carry no hook of the old ones: tensor
parallelism registers none on split experts (sequence parallelism's gradient sums are for
the replicated parameters).

What it does not do (yet): whole experts per TP rank (Experts(split="experts")) under it;
sharding the experts' parameters themselves over their replicas at ZeRO-3; overlapping their
reduction over the replicas with backward; capacity factors or token dropping (every routed
token is computed: dropless); overlapping the all-to-alls with compute (DeepEP, Megatron's A2A
overlap); the routers' load-balancing loss is computed by the model on each rank's own tokens,
as under plain data parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import _peft, fault, placement
from parallel_layers.tensor_parallel.experts import (Experts, JoinedToInputs, is_tensor_parallel_experts, layout_problem,
                                                     unreached_weights)

_DISPATCH = "expert-parallel all_to_all"


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding a mixture of experts' stacked expert weights (transformers 5's
    `<Family>Experts`: a 3-D `gate_up_proj` and `down_proj`)."""
    spec = Experts()
    return [(name, m) for name, m in model.named_modules()
            if all(isinstance(getattr(m, attr, None), nn.Parameter) and getattr(m, attr).dim() == 3
                   for attr in (spec.column, spec.row))]


def degree(expert_parallel, dp: int) -> int:
    """How many data-parallel ranks each MoE layer's experts are spread over: dp for True, 1
    (no expert parallelism) for False, else the number given, which must divide dp (Note [expert
    replicas])."""
    divisors = [d for d in range(1, dp + 1) if dp % d == 0]
    if isinstance(expert_parallel, bool):
        return dp if expert_parallel else 1
    if not isinstance(expert_parallel, int):
        raise TypeError(f"expert_parallel must be True (the experts over all dp={dp} ranks), False, or the number of "
                        f"data-parallel ranks to spread them over (a divisor of dp: {divisors}), got "
                        f"{expert_parallel!r}")
    if expert_parallel not in divisors:
        raise ValueError(f"expert_parallel={expert_parallel} must divide dp={dp} (the experts are spread over groups "
                         f"of that many data-parallel ranks and replicated over dp / expert_parallel of them); valid "
                         f"values at dp={dp}: {divisors} (or True, False)")
    return expert_parallel


def check(model: nn.Module, ep: int, flag=True) -> list[tuple[str, nn.Module]]:
    """Why `model` cannot take expert parallelism over `ep` ranks (asked for as
    expert_parallel=`flag`), raised (the same on every rank: it depends on the model and the
    degrees only); else its experts modules. Before tensor parallelism converts them."""
    found = expert_modules(model)
    if not found:
        raise ValueError(f"parallelize: expert_parallel={flag!r} found no mixture-of-experts module in "
                         f"{type(model).__name__} (a module holding stacked 3-D gate_up_proj [experts, 2 * "
                         "intermediate, hidden] and down_proj [experts, hidden, intermediate], as transformers 5's "
                         "Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE hold them)")
    over = f"dp={ep} ranks" if flag is True else f"ep={ep} data-parallel ranks"
    modules = dict(model.named_modules())
    for name, module in found:
        # peft's ParamWrapper adapts the stacked expert weights in place (peft 0.21's LoRA on
        # "all-linear" does): its lora_A / lora_B hold every expert's adapter, interleaved, and it
        # adds their product to the whole [experts, ...] weight, which a rank holding some experts
        # no longer has (it failed inside peft with "The expanded size of the tensor ... must match").
        wrapped = [n for n in _ancestors(name) if _peft.is_lora_layer(modules[n])]
        if wrapped:
            raise ValueError(f"parallelize: expert_parallel={flag!r} cannot split {name}: peft adapts its stacked "
                             f"expert weights ({wrapped[-1]} is a {type(modules[wrapped[-1]]).__qualname__}, whose "
                             f"LoRA factors cover every expert), and expert parallelism keeps some experts per rank. "
                             f"Train this LoRA model with expert_parallel=False (ZeRO 1-3 shard it over dp instead), "
                             f"or leave the experts out of the adapter (a peft LoraConfig whose target_modules do not "
                             f"match them)")
        problem = layout_problem(module, Experts(split="experts"), ep)
        if problem is not None:
            problem = problem.replace("tensor-parallel", "expert-parallel (data-parallel)")
            problem = problem.replace("tp=", "dp=" if flag is True else "ep=")
            raise ValueError(f"parallelize: expert_parallel={flag!r} over {over} cannot split {name}: {problem}")
    return found


def _ancestors(name: str) -> list[str]:
    """The dotted names of the modules holding module `name`, outermost first (the model: "")."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def check_tensor_parallel(model: nn.Module, names: list[str]) -> None:
    """Under tensor parallelism the experts must have been split by Experts() (each expert's
    intermediate features over tp), not as whole experts or left whole (Note [experts over the
    data-parallel ranks])."""
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if is_tensor_parallel_experts(module) and module.expert_offset is None:
            continue
        how = ("whole experts per tensor-parallel rank (Experts(split='experts'))" if is_tensor_parallel_experts(module)
               else "not split (no Experts() entry in the plan)")
        raise ValueError(f"parallelize: expert_parallel=True at tp > 1 splits each expert of {name} over the "
                         f"tensor-parallel ranks as its MLP (Experts(), the published 'moe_tp_experts') and the "
                         f"experts over the data-parallel ranks; the plan left them {how}")


def expert_groups(mesh, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's expert-parallel group: `ep` consecutive data-parallel ranks, apart from the dp
    group; its replica group: the dp / ep data-parallel ranks at the same place in theirs) (Note
    [expert replicas]). Every rank creates every group (torch names a group by how many each rank
    has created, so all must create the same ones), including the pipeline stages without
    experts."""
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    pp, dp, tp = ranks.shape
    blocks = ranks.permute(0, 2, 1).reshape(pp, tp, dp // ep, ep)  # [.., replica, expert-parallel rank]
    spread, _ = dist.new_subgroups_by_enumeration(blocks.reshape(-1, ep).tolist())
    replicas, _ = dist.new_subgroups_by_enumeration(blocks.transpose(2, 3).reshape(-1, dp // ep).tolist())
    return spread, replicas


_EP_CLASSES: dict[type, type] = {}


def convert(module: nn.Module, group: dist.ProcessGroup, replicas: dist.ProcessGroup) -> None:
    """Keep this rank's experts of `module` and dispatch its tokens by all-to-all over `group`;
    `replicas` holds the same experts (Note [experts over the data-parallel ranks], Note [expert
    replicas]); `check` must have passed."""
    spec = Experts(split="experts")
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    total = getattr(module, spec.column).shape[0]
    local = total // ep
    for attr in (spec.column, spec.row):
        full = getattr(module, attr)  # whole, or each expert's tensor-parallel shard
        p = nn.Parameter(full.detach().narrow(0, rank * local, local).clone(), requires_grad=full.requires_grad)
        placement.set_local_layout(p, placement.narrowed(placement.local_layout(full), 0, rank * local, local))
        if hasattr(full, "tp_shard"):  # split over tp as well (what a second parallelize refuses)
            p.tp_shard = full.tp_shard
        placement.set_expert_group(p, group, replicas)
        if p.requires_grad:  # the sum over the group's tokens, averaged as the replicas' gradients are
            p.register_hook(lambda g, ep=ep: g / ep)
        setattr(module, attr, p)
    # not `expert_offset`: tensor_parallel/experts.py's forward renumbers ids by that one
    module.num_experts, module.expert_parallel_offset, module.global_experts = local, rank * local, total
    cls = type(module)
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _forward(cls.forward)})
    module.__class__ = _EP_CLASSES[cls]
    module.expert_group = group


def is_expert_parallel_module(module: nn.Module) -> bool:
    return type(module) in _EP_CLASSES.values()


def used_in(model: nn.Module) -> bool:
    """Whether any module of `model` dispatches its tokens by all-to-all (a forward, evaluation
    included, is then a collective over the expert group)."""
    return any(is_expert_parallel_module(m) for m in model.modules())


def _forward(own_forward):
    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        group, local, total = self.expert_group, self.num_experts, self.global_experts
        ep = total // local
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=total)
        received = torch.empty_like(counts)  # [source rank, local expert]
        with fault.collective(_DISPATCH, group):
            dist.all_to_all_single(received, counts, group=group)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.view(ep, local).sum(1).tolist()
        rows = _AllToAll.apply(hidden_states[order // k], recv, send, group)
        ids = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(ep), received)
        ones = torch.ones(ids.shape[0], 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
        out = own_forward(self, rows, ids[:, None], ones)
        if torch.is_grad_enabled():  # a rank given no row still joins the backward
            joined = ([rows] if rows.requires_grad else []) + unreached_weights(self, out)
            out = JoinedToInputs.apply(out, *joined) if joined else out
        back = _AllToAll.apply(out, send, recv, group)  # in `order`
        slots = torch.empty_like(back).index_copy(0, order, back).view(tokens, k, -1)
        return (slots * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(1).to(hidden_states.dtype)
    return forward


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent in blocks of `send` rows to the group's ranks, `recv` rows received from
    each; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _all_to_all(x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with fault.collective(_DISPATCH, group):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def apply(model: nn.Module, mesh, names: list[str], ep: int) -> None:
    """Expert parallelism over groups of `ep` data-parallel ranks of `mesh` on the MoE layers
    `names` of `model` (`check`'s, after tensor parallelism if any)."""
    if mesh.size(mesh.mesh_dim_names.index("tp")) > 1:
        check_tensor_parallel(model, names)
    group, replicas = expert_groups(mesh, ep)
    modules = dict(model.named_modules())
    for name in names:
        convert(modules[name], group, replicas)
