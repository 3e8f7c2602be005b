"""`tensor_parallel.parallelize(model, plan)`: turn the linear layers of an existing model into
tensor-parallel ones, in place, keeping its weights. This is the TP step of the composing
`parallel_layers.parallelize(model, ctx, tp_plan=...)` (parallel_layers/parallelize.py), and
usable alone when tensor parallelism is all a model needs.

    plan = {
        "transformer.h.*.attn.c_attn": Column(fused=3),     # GPT-2 fused QKV (Conv1D)
        "transformer.h.*.attn.c_proj": "row",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
    }
    tensor_parallel.parallelize(model, plan, tp_group=ctx.tp_group)

Keys are fnmatch patterns over module names (`model.named_modules()`); every pattern must
match at least one module. Values are "column", "row", or Column(...) / Row(...) for
options. Supported modules: nn.Linear and Hugging Face's Conv1D (GPT-2's, weight [in, out]).

VocabParallel() on an nn.Embedding makes it a VocabParallelEmbedding (rows split over tp),
replacing the module wherever the model holds it: a head tied to it that reads it through
`tied_logits` / `tied_cross_entropy` (tensor_parallel/vocab.py) stays tied and computes
vocabulary-parallel logits and loss (Note [vocab-parallel head] there).

Column(activation="gelu_tanh") applies the GeLU in the layer's fused GEMM + bias + GeLU kernel;
the model's own activation module after it (an nn.GELU with the same approximation, in the same
parent) is then named "fused" in the plan and becomes the identity.

Fused projections: Column(fused=k) splits the weight into k equal logical sub-matrices
(e.g. Q, K, V) and shards each one, so rank r computes [q_r, k_r, v_r]; Column(fused=(a, b))
gives unequal sizes. A naive split of a fused weight would be silently wrong.

Experts() ("experts"; transformers' "moe_tp_experts") on a mixture-of-experts module whose
experts are stacked 3-D parameters (gate_up_proj [experts, 2 * intermediate, hidden], down_proj
[experts, hidden, intermediate]) splits every expert as its SwiGLU MLP, all-reducing the
module's output (tensor_parallel/experts.py). The published plans also name those two
parameters ("packed_colwise", "rowwise"): entries naming parameters are accepted when they say
what the Experts() entry of their module does, and refused otherwise.

Attention modules: a column-sharded projection inside a module that has `head_dim` must
cover whole heads on every rank (heads % tp == 0), else the plan is refused. The parent's
per-rank head bookkeeping is fixed where it is stored: `num_heads` is divided by tp and a
GPT-2 style `split_size` (the width at which the fused QKV output is split) becomes the
local width. Llama-style attention reshapes with -1 heads and needs nothing.

Everything that is not in the plan stays replicated, but for the per-head parameters of Note
[per-head parameters], which parallelize finds itself. A replicated parameter that reads the
replicated activations (the norms between the layers, the embedding without VocabParallel) gets
the same gradient on every rank and stays in sync. One that reads a column layer's sharded
output sees only this rank's heads or features, so its gradient is this rank's part of the sum:
Qwen3's and Gemma 3's per-head `q_norm` / `k_norm` inside attention. Name such a module
"replicated" / Replicated() in the plan (transformers' "replicated_with_grad_allreduce", which
those models publish): its parameters stay whole and their gradients are summed over the TP
group as they are produced (`reduce_grad_over_tp`). A Hugging Face model whose published plan
marks a module so, beside a column layer that an explicit plan shards, is refused if the plan
leaves that module out: it would train, silently, with the replicas drifting apart (at tp > 1
without sequence parallelism, which sums every replicated parameter of the decoder layers).

Without a plan, a Hugging Face model's published one is used (Note [published plans]).

sequence_parallel=True (the Hugging Face decoders of hf_sequence_parallel.FAMILIES - Llama,
GPT-2, GLM-4, Phi-3, OLMo 2, Mixtral, ... - activations [batch, seq, hidden]): between the
attention and MLP regions each rank holds 1 / tp of the sequence; the split, the gathers and
the gradient sums are hf_sequence_parallel.py's (Note [hf sequence parallel boundaries]). A
column layer there that gathers its output (Column(gather_output=True), "colwise_gather_output")
gathers only its features, the region's entry having gathered the sequence, and a row layer
after it that splits its whole input (Row(input_is_parallel=False)) reduce-scatters on the
sequence (Note [gathered regions under sequence parallelism]). Without it, in the same
families, a region whose column layers read one input (attention's q, k and v) all-reduces
their input gradients once, at its entry (Note [one reduction per region]).

fused_kernels=True (the default): after the conversion, a Hugging Face decoder's SwiGLU MLPs
(gate_proj and up_proj column-parallel, down_proj row-parallel) become SwiGLUMLP, one packed
column-parallel GEMM with the activation fused, over the same parameters, and the ones whose
gate and up are one packed layer (Phi-3, GLM, GLM-4; split block by block, not gathered as
their published plans ask: Note [packed MLPs split block by block]) PackedSwiGLUMLP; its
RMSNorms and its attention residual adds are fused too (parallel_layers/fused.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import _peft, fault, placement
from parallel_layers import fused as fused_modules
from parallel_layers.parallel_dims import divisors
from parallel_layers.tensor_parallel import comm
from parallel_layers.tensor_parallel import experts as moe
from parallel_layers.tensor_parallel import hf_sequence_parallel, lora, region_random
from parallel_layers.tensor_parallel.experts import Experts
from parallel_layers.tensor_parallel.layers import (ColumnParallelLinear, PackedSwiGLUMLP, RowParallelLinear, SwiGLUMLP,
                                                   reduce_grad_over_tp)
from parallel_layers.tensor_parallel.sharding import keep_requires_grad, sharded_parameter
from parallel_layers.tensor_parallel.vocab import VocabParallelEmbedding, subclass_problem


@dataclasses.dataclass(frozen=True)
class Column:
    fused: int | tuple[int, ...] | None = None
    gather_output: bool = False
    activation: str | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    input_is_parallel: bool = True


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A module whose parameters stay whole on every rank but read a column layer's sharded
    output (a per-head norm): their gradients are summed over the TP group."""


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """An nn.Embedding split on its rows (the vocabulary), with the head tied to it."""

    sequence_parallel: bool = False


_FUSED = "fused"  # an activation module applied by the Column(activation=...) before it
_STYLES = {"column": Column(), "row": Row(), "vocab_parallel": VocabParallel(), "replicated": Replicated(),
           "experts": Experts()}
_GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}

# Note [published plans]: Hugging Face configs publish `base_model_tp_plan` (keys relative to
# the base model, whose attribute name is `model.base_model_prefix`); a model instance's
# `_tp_plan` (transformers 5) is the whole plan, prefixed, LM head and embedding included.
# With plan=None, parallelize uses it, with transformers' style names mapped to ours; a style
# with no counterpart here is refused with the module it names. "embedding_rowwise" (rows = the
# vocabulary; Llama, Qwen2 and Mistral's published plans ask it) is VocabParallel(), in a
# published plan as in an explicit one; its parity is tested plan-free at tp=2, with Hugging
# Face sequence parallelism (which reduce-scatters its partial sums at decoder layer 0, Note
# [hf sequence parallel boundaries]), in pipeline stages and loaded from the meta device.
# "embedding_colwise" (no family here asks it) leaves the embedding replicated. Families that
# publish no plan (GPT-2 in transformers 5.23) get a built-in one. A head tied to the input
# embedding stays replicated, and so does that embedding: a Hugging Face head ties by sharing
# the weight parameter, which sharding would untie (VocabParallel() on such an embedding, in
# an explicit plan, is refused). A published pattern that matches no module or parameter is
# skipped, as transformers skips it: the plans are written for every variant of a family
# (Qwen2-MoE's dense-MLP entries in a model whose layers are all MoE). What it would have named
# stays replicated: correct, and a row layer whose column partner was skipped fails on its
# first forward, on its input's width. An explicit plan's pattern must match.
HF_STYLES = {
    "colwise": Column(),
    "colwise_gather_output": Column(gather_output=True),
    "packed_colwise": Column(fused=2),  # [gate; up] packed in one weight
    "rowwise": Row(),
    "rowwise_split_input": Row(input_is_parallel=False),
    "embedding_rowwise": VocabParallel(),  # rows = the vocabulary
    "replicated_with_grad_allreduce": Replicated(),  # Qwen3's and Gemma 3's q_norm / k_norm
    "moe_tp_experts": Experts(),  # stacked experts, each split as its MLP (tensor_parallel/experts.py)
}
_GRAD_SUM_STYLE = "replicated_with_grad_allreduce"
# how transformers' plans spell what Experts() does to the stacked expert parameters
_EXPERT_PARAMETER_STYLES = {Experts().column: "packed_colwise", Experts().row: "rowwise"}
_REPLICATED = ("embedding_colwise",)
BUILTIN_PLANS = {
    "gpt2": {
        "transformer.h.*.attn.c_attn": Column(fused=3),  # fused [q; k; v], Conv1D
        "transformer.h.*.attn.c_proj": "row",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
    },
}


def _hf_plan(model: nn.Module) -> dict:
    """The plan a Hugging Face model publishes, keys prefixed to the model's module names and
    values in transformers' style names; {} if it publishes none."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        config = getattr(model, "config", None)
        prefix = getattr(model, "base_model_prefix", "")
        plan = getattr(config, "base_model_tp_plan", None) or {}
        if prefix and hasattr(model, prefix):
            plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan) if isinstance(plan, Mapping) else {}


def published_plan(model: nn.Module) -> dict:
    """The plan a Hugging Face model publishes (or our built-in one for its family), in our styles."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family in BUILTIN_PLANS:
        return dict(BUILTIN_PLANS[family])
    plan = _hf_plan(model)
    if not plan:
        raise ValueError(f"parallelize: {type(model).__name__} publishes no tensor-parallel plan (no "
                         f"config.base_model_tp_plan) and there is no built-in one for model_type {family!r} "
                         f"(built-in: {sorted(BUILTIN_PLANS)}); pass an explicit plan (tp_plan= to "
                         "parallel_layers.parallelize, plan= to tensor_parallel.parallelize)")
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    tied = _tied_to_input_embedding(model)
    experts = [n for n in modules if any(fnmatch.fnmatchcase(n, p) for p, s in plan.items() if s == "moe_tp_experts")]
    out = {}
    for pattern, style in plan.items():
        if style in _REPLICATED:
            continue
        if not any(fnmatch.fnmatchcase(n, pattern) for n in (*modules, *params) if n):
            continue  # a plan written for the family's every variant: Qwen2-MoE's dense-MLP entries
        named = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if named and not any(fnmatch.fnmatchcase(n, pattern) for n in modules if n) and \
                all(n.rpartition(".")[0] in experts and _EXPERT_PARAMETER_STYLES.get(n.rpartition(".")[2]) == style
                    for n in named):
            continue  # what the Experts() entry of their module does (its parameters' spelling)
        if style not in HF_STYLES:
            names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)][:3]
            raise ValueError(f"parallelize: {type(model).__name__}'s published plan asks {style!r} for {pattern!r} "
                             f"(e.g. {names}); supported Hugging Face styles: {sorted(HF_STYLES)}; pass an "
                             "explicit plan with 'column' / 'row' entries instead (tp_plan= to "
                             "parallel_layers.parallelize, plan= to tensor_parallel.parallelize)")
        if any(fnmatch.fnmatchcase(n, pattern) for n in tied) or (tied and style == "embedding_rowwise"):
            continue  # the tie and both its ends stay replicated
        out[pattern] = HF_STYLES[style]
    names = [n for n in (*modules, *params) if n]
    if not any(fnmatch.fnmatchcase(n, pattern) for pattern in plan for n in names):
        # each unmatched entry is skipped above (a variant's); none matching at all means the plan
        # is not this model's names - a wrapper's (peft's PeftModel before it was refused), where
        # tp=2 converted nothing and every rank trained the whole model, silently
        raise ValueError(f"parallelize: {type(model).__name__}'s published plan ({len(plan)} entries, e.g. "
                         f"{next(iter(plan))!r}) matches none of its modules (e.g. {names[:2]}), so nothing would be "
                         f"split. Parallelize the transformers model itself, or pass an explicit plan (tp_plan= to "
                         f"parallel_layers.parallelize, plan= to tensor_parallel.parallelize)")
    return _split_packed_mlps(model, out)


# Note [packed MLPs split block by block]: Phi-3, GLM and GLM-4 pack an MLP's gate and up
# projections in one layer and publish it "colwise_gather_output" with "rowwise_split_input"
# for down_proj, because their forward chunks the layer's output in two (`gate, up =
# gate_up_proj(x).chunk(2, -1)`): split as one block, rank r's chunk would hold gate features
# only (or up features only). That plan all-gathers the [tokens, 2 * intermediate] output and
# runs the activation and the product whole on every rank, before down_proj takes its slice.
# Split as two blocks instead (Column(fused=2), transformers' "packed_colwise"), rank r holds
# [gate_r; up_r], so the same chunk(2) gives it matching gate and up features, the activation
# and product are elementwise, and down_proj reads this rank's slice of the intermediate
# features as a row layer does: the computation is the same, with no gather (an all-reduce of
# the output, as any MLP) and 1 / tp of the elementwise work. It is applied where every module
# the MLP pattern names computes exactly that form (fused.is_packed_gated_mlp, read from its
# forward's source); any other form keeps the published entries.
def _split_packed_mlps(model: nn.Module, plan: dict) -> dict:
    """The published plan with packed gated MLPs split block by block (Note [packed MLPs split
    block by block])."""
    modules = dict(model.named_modules())
    for pattern, spec in list(plan.items()):
        parent, _, leaf = pattern.rpartition(".")
        down = f"{parent}.down_proj"
        gathered = spec == Column(gather_output=True) and plan.get(down) == Row(input_is_parallel=False)
        if leaf != "gate_up_proj" or not gathered:
            continue
        mlps = [m for n, m in modules.items() if n and fnmatch.fnmatchcase(n, parent)]
        if mlps and all(fused_modules.is_packed_gated_mlp(m) for m in mlps):
            plan[pattern], plan[down] = HF_STYLES["packed_colwise"], HF_STYLES["rowwise"]
    return plan


def _tied_to_input_embedding(model: nn.Module) -> set[str]:
    """Names of modules whose weight is the input embedding's (a tied LM head; also the base layer
    of an embedding peft adapted, whose `weight` is its base's: so an adapted embedding stays
    whole, with its adapter, under the published plan - Note [LoRA under tensor parallelism])."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    if weight is None:
        return set()
    return {n for n, m in model.named_modules() if m is not embedding and getattr(m, "weight", None) is weight}


def is_hf_conv1d(module) -> bool:
    """transformers' Conv1D (GPT-2's layers): a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _as_linear_weights(module: nn.Module):
    """(weight [out, in], bias or None) of an nn.Linear or a HF Conv1D, without copying."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), module.bias.detach() if module.bias is not None else None
    if is_hf_conv1d(module):
        return module.weight.detach().t(), module.bias.detach() if module.bias is not None else None
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        raise TypeError(f"parallelize: the plan names a {type(module).__name__}: this model is already tensor-parallel "
                        "(parallelize ran on it before); build it again to parallelize it another way")
    raise TypeError(f"parallelize: {type(module).__name__} is not supported; plan entries must name nn.Linear or "
                    "Hugging Face Conv1D modules")


def _fused_sizes(fused, out_features: int, name: str):
    if fused is None:
        return None
    if isinstance(fused, int):
        if fused < 1 or out_features % fused:
            raise ValueError(f"parallelize: {name} has out_features {out_features}, which cannot be fused={fused} "
                             f"equal sub-matrices; valid values of fused are {divisors(out_features, 64)}, or a "
                             "tuple of block sizes summing to out_features")
        return (out_features // fused,) * fused
    if sum(fused) != out_features:
        raise ValueError(f"parallelize: {name} has out_features {out_features}, but fused={tuple(fused)} sums to "
                         f"{sum(fused)}; the block sizes must sum to {out_features}")
    return tuple(fused)


def _check_heads(parent: nn.Module, parent_name: str, blocks: tuple[int, ...], tp: int) -> None:
    """Refuse a column layer's shards that would cut heads (its parent has `head_dim`)."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return
    for block in blocks:
        if (block // tp) % head_dim:
            config = getattr(parent, "config", None)
            counts = {k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")
                      if isinstance(getattr(config, k, None), int)}
            source = (" (" + ", ".join(f"config.{k} = {v}" for k, v in counts.items()) + "; valid tp: "
                      f"{divisors(math.gcd(*counts.values()), 64)})") if counts else ""
            raise ValueError(
                f"parallelize: {parent_name} has head_dim {head_dim}; sharding a projection block of {block} "
                f"features ({block // head_dim} heads) over tp={tp} leaves {block / tp:g} features per rank, not a "
                f"whole number of heads. The number of heads (and of key/value heads) must be divisible by "
                f"tp={tp}{source}.")


def _check_and_fix_heads(parent: nn.Module, parent_name: str, blocks: tuple[int, ...], tp: int, fixed: set) -> None:
    """Refuse shards that cut heads; fix the parent's per-rank head bookkeeping once."""
    _check_heads(parent, parent_name, blocks, tp)
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or id(parent) in fixed:
        return
    fixed.add(id(parent))
    if isinstance(getattr(parent, "num_heads", None), int):
        if parent.num_heads % tp:
            raise ValueError(f"parallelize: {parent_name}.num_heads = {parent.num_heads} is not divisible by tp={tp}")
        parent.num_heads //= tp
    if isinstance(getattr(parent, "split_size", None), int):
        parent.split_size //= tp


def parallelize(model: nn.Module, plan: dict | None = None, tp_group: dist.ProcessGroup | None = None, *,
                sequence_parallel: bool = False, fused_kernels: bool = True) -> nn.Module:
    """Replace the modules named by `plan` with tensor-parallel layers (see the module doc);
    plan=None: the model's published plan (Note [published plans]). sequence_parallel=True:
    a Hugging Face decoder's activations between the regions split on the sequence (Note [hf
    sequence parallel boundaries]). fused_kernels=True: then a Hugging Face decoder's SwiGLU
    MLPs run as one packed column-parallel GEMM with the activation fused, and its RMSNorms and
    attention residual adds as fused ops (parallel_layers/fused.py). At tp > 1 it ends with a
    collective of the TP group (Note [one random stream per tensor-parallel group]): every rank
    of the group calls it."""
    for flag, value in (("sequence_parallel", sequence_parallel), ("fused_kernels", fused_kernels)):
        if not isinstance(value, bool):
            raise TypeError(f"parallelize: {flag} must be True or False, got {value!r}")
    if _peft.is_wrapper(model):  # the plan names the adapted transformers model's modules (Note [peft models])
        parallelize(model.get_base_model(), plan, tp_group, sequence_parallel=sequence_parallel,
                    fused_kernels=fused_kernels)
        return model
    sp_layout = hf_sequence_parallel.find_layout(model) if sequence_parallel else None
    if plan is None:
        plan = published_plan(model)
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a dict of module-name pattern -> style (e.g. "
                        f"{{'layers.*.fc1': 'column'}}), got {type(plan).__name__}")
    tp = comm.group_size(tp_group)
    modules = dict(model.named_modules())
    targets: dict[str, Column | Row | VocabParallel | Replicated | Experts | str] = {}
    parameter_entries = {}
    for pattern, style in plan.items():
        spec = (_STYLES.get(style) or HF_STYLES.get(style, style)) if isinstance(style, str) else style
        if not isinstance(spec, (Column, Row, VocabParallel, Replicated, Experts)) and spec != _FUSED:
            raise ValueError(f"parallelize: plan[{pattern!r}] = {style!r}; use 'column', 'row', 'replicated', "
                             f"'experts', Column(...), Row(...), VocabParallel(...), Replicated(), Experts(...) or "
                             f"'fused', or a Hugging Face style: {sorted(HF_STYLES)}")
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            parameter_entries[pattern] = (style, spec)
        for name in matched:
            targets[name] = spec
    for pattern, (style, spec) in parameter_entries.items():
        _check_expert_parameters(model, pattern, style, spec, targets)
    # peft's modules_to_save (a trainable copy of a module beside its original): both split as
    # the plan splits the module
    for name in [n for n in targets if _peft.is_saved_copy(modules[n])]:
        spec, wrapper = targets.pop(name), modules[name]
        targets.update({f"{name}.original_module": spec,
                        **{f"{name}.modules_to_save.{a}": spec for a in wrapper.modules_to_save}})
    # LoRA layers: the plan splits each one's base layer, and its adapters with it (Note [LoRA
    # under tensor parallelism] in lora.py); `bases` is what each name's split computes
    adapted = {name: modules[name] for name in targets if lora.is_lora_layer(modules[name])}
    for name, spec in targets.items():
        why = _peft.tensor_parallel_refusal(name, modules[name]) or (
            lora.refusal(name, modules[name], _spec_kind(spec), spec) if name in adapted else None)
        if why:
            raise ValueError(why if why.startswith("parallelize") else f"parallelize: {why}")
    bases = {**modules, **{name: layer.base_layer for name, layer in adapted.items()}}
    for name, spec in targets.items():  # checked before any module is replaced
        if spec == _FUSED:
            _check_fused_activation(model, name, modules[name], targets)
        elif isinstance(spec, (Column, Row)):
            _check_splits(model, bases, name, spec, tp)
        elif isinstance(spec, VocabParallel):
            _check_embedding(model, name, modules[name])
        elif isinstance(spec, Experts) and (problem := moe.layout_problem(modules[name], spec, tp)):
            raise ValueError(f"parallelize: {name}: {problem}")
    if tp > 1 and sp_layout is None:  # at tp=1 nothing is sharded; sequence parallelism sums them itself
        _check_grad_sums_kept(model, modules, targets)
    if sp_layout is not None:
        hf_sequence_parallel.check_plan(model, sp_layout, targets, lambda spec: isinstance(spec, Column),
                                        lambda spec: isinstance(spec, Row), lambda spec: isinstance(spec, Experts),
                                        lambda spec: isinstance(spec, Column) and spec.gather_output)
    fixed_parents: set = set()
    column_outputs: dict[str, set[int]] = {}  # parent -> output features of its sharded, ungathered columns
    for name, spec in targets.items():
        module = bases[name]
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        holder, attr = (modules[name], "base_layer") if name in adapted else (parent, child)
        if spec == _FUSED:  # the Column(activation=...) beside it applies it
            setattr(parent, child, nn.Identity())
            continue
        if isinstance(spec, VocabParallel):
            _convert_embedding(model, name, module, spec, tp_group)
            continue
        # inside a decoder layer under SP: the region gathers the sequence for its column layers,
        # the row layers reduce-scatter it (Note [hf sequence parallel boundaries])
        sp = dict(sequence_parallel=True, seq_dim=hf_sequence_parallel.SEQ_DIM) \
            if sp_layout is not None and sp_layout.holds(name) else {}
        if isinstance(spec, Experts):
            moe.convert(module, spec, tp_group, sequence_parallel=bool(sp))
            continue
        if isinstance(spec, Replicated):  # the module stays; its gradients are summed over tp
            for p in modules[name].parameters():  # a LoRA layer's adapters too
                reduce_grad_over_tp(p, tp_group)
            continue
        weight, bias = _as_linear_weights(module)
        out_features, in_features = weight.shape
        if isinstance(spec, Column):
            fused = _fused_sizes(spec.fused, out_features, name)
            _check_and_fix_heads(parent, parent_name, fused or (out_features,), tp, fixed_parents)
            if fused is None and not spec.gather_output:
                column_outputs.setdefault(parent_name, set()).add(out_features)
            # a column that gathers its output under SP: the region gathered the sequence, the
            # layer gathers only its features (Note [gathered regions under sequence parallelism])
            column_sp = {} if spec.gather_output else sp
            layer = ColumnParallelLinear(
                in_features, out_features, bias is not None, tp_group=tp_group, gather_output=spec.gather_output,
                activation=spec.activation, fused_sizes=fused, _full=(weight, bias), shared_input=bool(sp),
                **column_sp)
        else:
            layer = RowParallelLinear(in_features, out_features, bias is not None, tp_group=tp_group,
                                      input_is_parallel=spec.input_is_parallel, _full=(weight, bias), **sp)
        if is_hf_conv1d(module):  # the state_dict entry stays Conv1D's [in, out] (Note [transposed weights])
            placement.transposed(layer.weight)
        setattr(holder, attr, keep_requires_grad(layer, module))
    if tp > 1:
        _per_head_parameters(model, modules, targets, column_outputs, tp_group)
    if fused_kernels:  # before the SP hooks, which then land on the fused modules
        fused_modules.fuse(model)
    if sp_layout is not None:
        hf_sequence_parallel.apply(model, sp_layout, tp_group)
    elif (layout := hf_sequence_parallel.known_layout(model)) is not None:
        hf_sequence_parallel.share_region_inputs(model, layout, tp_group)
    for name, layer in adapted.items():  # the base layers' settings are final now (shared_input)
        if not isinstance(targets[name], Replicated):
            lora.convert(layer, tp_group)
    if tp > 1:
        share_random_state(tp_group, next((p.device for p in model.parameters()), None))
        region_random.seed(tp_group)  # after the shared stream (Note [a random stream per rank inside TP regions])
        _install_region_streams(model, sp_layout)
    return model


def _spec_kind(spec) -> str:
    return ("column" if isinstance(spec, Column) else "row" if isinstance(spec, Row) else
            "replicated" if isinstance(spec, Replicated) else "vocab-parallel" if isinstance(spec, VocabParallel)
            else "experts" if isinstance(spec, Experts) else str(spec))


def _install_region_streams(model: nn.Module, sp_layout) -> None:
    """The region hooks of region_random.py on every parent holding sharded-output column
    layers and the row layers that take sharded inputs, where it drops anything; under
    sequence parallelism, the hooks of every decoder layer that drops anything (Note [draws
    under sequence parallelism])."""
    if sp_layout is not None:
        modules = dict(model.named_modules())
        regions = hf_sequence_parallel.regions(modules, sp_layout)
        # what draws inside a region whose values are replicated (its columns gather their outputs,
        # a MoE block) draws from the shared stream: a layer that draws nowhere else is left alone
        replicated = frozenset(id(m) for r in hf_sequence_parallel.replicated_regions(modules, sp_layout)
                               for m in modules[r].modules())
        for name in sp_layout.layers:
            layer = modules[name]
            if not region_random.draws(layer, skip=replicated):
                continue
            inside = [modules[r] for r in regions if r.startswith(name + ".")]
            children = [lora.tensor_parallel_base(c) for region in inside for c in region.children()]
            # a fused MLP's columns run inside its one GEMM, with nothing drawn before its row
            # layer: hooks on them would only turn it back into separate calls (Note [hooks on
            # fused parts] in layers.py)
            fused_columns = {id(c) for region in inside if isinstance(region, (SwiGLUMLP, PackedSwiGLUMLP))
                             for c in region.children()}
            region_random.install_sequence_parallel(
                layer, inside,
                [c for c in children if isinstance(c, ColumnParallelLinear) and not c.gather_output
                 and id(c) not in fused_columns],
                [c for c in children if isinstance(c, RowParallelLinear)])
            for m in (layer, *inside):
                m._pl_region_streams = True
        return
    for parent in model.modules():
        children = [lora.tensor_parallel_base(c) for c in parent.children()]
        columns = [c for c in children if isinstance(c, ColumnParallelLinear) and not c.gather_output]
        rows = [c for c in children if isinstance(c, RowParallelLinear) and c.input_is_parallel]
        if columns and rows and region_random.draws(parent) and not getattr(parent, "_pl_region_streams", False):
            region_random.install(parent, columns, rows)
            parent._pl_region_streams = True


# Note [one random stream per tensor-parallel group]: the ranks of a TP group compute the
# replicated parts of the model (the residual stream, norms, routers) each for itself, and
# must get the same values: any random draw there must be the same on every rank. Mixtral's
# router jitter (`router_jitter_noise`, a uniform draw over the hidden states in training) and
# dropout on the residual stream are such draws. With a different seed per rank (a common
# pattern: torch.manual_seed(rank)) the ranks routed 10-12 of 144 tokens a layer to different
# experts and their replicated router weights drifted apart with no error. So parallelize hands
# the TP group one stream, as Megatron seeds every TP rank alike: each rank takes the CPU (and
# current CUDA device's) random state of the group's first rank. Data-parallel replicas keep
# their own streams, and checkpoints save and restore each rank's state, so a resumed group
# stays in step. Draws inside a TP region (attention dropout over this rank's heads) take a
# second stream, this rank's own (Note [a random stream per rank inside TP regions] in
# region_random.py).
def share_random_state(tp_group, device: torch.device | None = None) -> None:
    """Every rank of the TP group takes its first rank's random state (Note [one random
    stream per tensor-parallel group]); a collective of the group, so `parallelize` at tp > 1
    must run on every rank of it. `device`: the model's (its parameters'); a CUDA device's
    generator is shared too - that device's, or under NCCL the current device's for a model
    still on the meta device. What is broadcast is decided by the backend and the model's
    device, the same on every rank of the group, never by per-rank state. The states are byte
    tensors, broadcast as tensors (on that CUDA device under NCCL): the fake process group,
    which moves no data, then leaves each rank its own."""
    nccl = "nccl" in str(dist.get_backend(tp_group))
    cuda = device if device is not None and device.type == "cuda" else None
    if cuda is None and nccl:
        cuda = torch.device("cuda", torch.cuda.current_device())
    if cuda is not None and cuda.index is None:
        cuda = torch.device("cuda", torch.cuda.current_device())
    where = cuda if nccl else torch.device("cpu")
    src = dist.get_global_rank(tp_group, 0) if tp_group is not None else 0
    generators = [(torch.get_rng_state, torch.set_rng_state)]
    if cuda is not None:
        generators.append((lambda: torch.cuda.get_rng_state(cuda), lambda s: torch.cuda.set_rng_state(s, cuda)))
    for get, put in generators:
        state = get().to(where)
        with fault.collective("broadcast of the random state", tp_group):
            dist.broadcast(state, src=src, group=tp_group)
        put(state.cpu())


# Note [per-head parameters]: Cohere's q_norm / k_norm (use_qk_norm=True, as in Command R+) are
# LayerNorms whose weight is [heads, head_dim], applied to q_proj's (k_proj's) output viewed as
# [..., heads, head_dim]. With q_proj column-parallel, rank r's output holds heads
# [r * H / tp, (r + 1) * H / tp) only, and the whole [H, head_dim] weight does not broadcast with it:
# the first forward failed inside transformers (its own tp_plan="auto" fails the same way; the
# published plan does not name these norms). Such a parameter is sharded with the heads: rank r
# keeps rows [r * H / tp, (r + 1) * H / tp), a TP shard on dim 0 like a column layer's weight, so
# checkpoints, hf.load_pretrained and the export see the [H, head_dim] tensor. Which parameters: those
# of a module the plan leaves whole (no children; not a linear layer or an embedding) beside a
# column layer (same parent, which has `head_dim`: attention) whose output is neither gathered
# nor fused, with 2 or more dims, the last of head_dim, as many elements as that column layer has
# output features (its output, laid out [heads, ..., head_dim]), and dim 0 divisible by tp. Their gradients need no sum: each rank's rows see only its own heads, and
# under sequence parallelism the column layer's input is the gathered sequence.
# A 1-D parameter of head_dim elements in such a module, inside attention (the parent has
# `head_dim`), is a norm shared by all heads and applied to each (Qwen3's and Gemma 3's q_norm /
# k_norm; Phi's q_layernorm / k_layernorm with qk_layernorm=True): it stays whole, and since each
# rank applies it to its own heads only, its gradient is summed over tp (reduce_grad_over_tp, as
# for Replicated()). Qwen3 and Gemma 3 publish that ("replicated_with_grad_allreduce"); Phi does
# not, and its replicas drifted apart silently at tp=2 before this rule. A norm of the region's
# input has hidden elements, not head_dim (heads > 1), so it is never taken for one.
# Note [scalars in a TP region]: a module the plan leaves whole beside an un-gathered column layer
# applies its parameters to that layer's output, this rank's share of the features: Apertus's
# xIELU activation (also a Llama's with hidden_act="xielu") has learned scalars alpha_p and
# alpha_n, whose gradient on each rank summed its own half of the MLP's features only; the
# ranks' copies drifted apart with no error (review finding: rank 0 -1.19e-4, rank 1 -4.03e-4,
# plain -5.22e-4, the sum). A one-element parameter of such a module is summed over tp as a
# per-head norm is. (Under sequence parallelism every replicated parameter of a decoder layer
# already is, for its sequence chunk; the hook is registered once.) The rule assumes the scalar
# acts on the column layer's output, as an activation does; one applied to the region's
# replicated input or to the row layer's reduced output would get tp times its gradient (no
# transformers model was found with one there).
def _per_head_parameters(model: nn.Module, modules: dict, targets: dict, column_outputs: dict[str, set[int]],
                         tp_group) -> None:
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    for parent_name, outputs in column_outputs.items():
        parent = modules[parent_name] if parent_name else model
        head_dim = getattr(parent, "head_dim", None)
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            linear = isinstance(child, (nn.Linear, nn.Embedding)) or is_hf_conv1d(child)
            if name in targets or len(child._modules) or linear:
                continue
            for param_name, p in list(child.named_parameters(recurse=False)):
                per_head = p.dim() >= 2 and p.shape[-1] == head_dim and p.numel() in outputs
                if per_head and p.shape[0] % tp == 0 and not hasattr(p, "tp_shard"):
                    shard = sharded_parameter(p.detach(), 0, tp, rank)
                    setattr(child, param_name, shard.requires_grad_(p.requires_grad))
                elif p.dim() == 1 and isinstance(head_dim, int) and p.numel() == head_dim:
                    reduce_grad_over_tp(p, tp_group)
                elif p.numel() == 1:  # a learned scalar of the sharded activations (Note [scalars in a TP region])
                    reduce_grad_over_tp(p, tp_group)


def _check_expert_parameters(model: nn.Module, pattern: str, style, spec, targets: dict) -> None:
    """A plan entry that names parameters, not modules, is accepted only as transformers'
    spelling of what an Experts() entry on their module does (its published plans say
    'packed_colwise' for experts.gate_up_proj and 'rowwise' for experts.down_proj beside
    'moe_tp_experts' for experts); anything else matches no module and is refused."""
    named = [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
    if not named:
        raise ValueError(f"parallelize: plan pattern {pattern!r} matches no module of {type(model).__name__}")
    for name in named:
        owner, _, leaf = name.rpartition(".")
        experts = targets.get(owner)
        if not isinstance(experts, Experts):
            raise ValueError(f"parallelize: plan pattern {pattern!r} names parameters ({name}), not modules; a plan "
                             "names modules, except for the expert weights of a module it marks Experts() "
                             "('moe_tp_experts'), which that entry splits")
        does = {experts.column: Column(fused=experts.packed), experts.row: Row()}.get(leaf)
        if does != spec or experts.split != "intermediate":
            how = (f"splits {experts.column} packed-column-wise ('packed_colwise') and {experts.row} row-wise "
                   "('rowwise')") if experts.split == "intermediate" else "gives each rank whole experts (both " \
                "parameters cut on dim 0)"
            raise ValueError(f"parallelize: plan[{pattern!r}] = {style!r}, but {owner} is {experts}, which {how}; "
                             f"{name} would be split otherwise. Drop the entry, or leave {owner} out of the plan")


def _check_splits(model: nn.Module, modules: dict, name: str, spec: Column | Row, tp: int) -> None:
    """The features a column (each fused block: whole heads in attention) or row layer splits
    divide by tp, named by the module (and, for a Hugging Face head, by the vocabulary and how to
    pad it)."""
    module = modules[name]
    weight, _ = _as_linear_weights(module)
    out_features, in_features = weight.shape
    if isinstance(spec, Row):
        sizes, what = (in_features,), "in_features"
    else:
        sizes, what = _fused_sizes(spec.fused, out_features, name) or (out_features,), "out_features"
        parent_name = name.rpartition(".")[0]
        _check_heads(modules[parent_name] if parent_name else model, parent_name, sizes, tp)
    bad = [size for size in sizes if size % tp]
    if not bad:
        return
    blocks = f" (fused blocks {list(sizes)})" if len(sizes) > 1 else ""
    message = (f"parallelize: {name} ({'column' if isinstance(spec, Column) else 'row'}-parallel) has {what} "
               f"{out_features if what == 'out_features' else in_features}{blocks}, and {bad[0]} does not divide by "
               f"tp={tp}; valid tensor-parallel sizes for it are {divisors(math.gcd(*sizes), 64)}")
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head) and get_head() is module:
        vocab = getattr(getattr(model, "config", None), "vocab_size", out_features)
        message += (f". It is the output head: its vocabulary ({vocab}) must divide by tp; pad it, e.g. "
                    f"model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of={tp}) before parallelize "
                    "(the embedding grows with it)")
    raise ValueError(message)


def _check_grad_sums_kept(model: nn.Module, modules: dict, targets: dict) -> None:
    """Refuse a plan that shards a column layer beside a module whose gradient the model's
    published plan sums over tp ("replicated_with_grad_allreduce": Qwen3's q_norm beside q_proj)
    but leaves that module out: it would read the column layer's shard of heads and train with a
    different gradient on each rank (the module doc)."""
    published = [pattern for pattern, style in _hf_plan(model).items() if style == _GRAD_SUM_STYLE]
    if not published:
        return
    regions = {name.rpartition(".")[0] for name, spec in targets.items() if isinstance(spec, Column)}
    missing = [name for name in modules if name and name not in targets and name.rpartition(".")[0] in regions
               and any(fnmatch.fnmatchcase(name, pattern) for pattern in published)]
    if missing:
        entries = ", ".join(f"{p!r}: 'replicated'" for p in published
                            if any(fnmatch.fnmatchcase(n, p) for n in missing))
        raise ValueError(
            f"parallelize: the plan shards column layers beside {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
            f"which {type(model).__name__}'s published plan marks 'replicated_with_grad_allreduce': they read those "
            "layers' shard of the heads, so their gradients must be summed over the tensor-parallel group. Add "
            f"{entries} to the plan, or use the published plan (tp_plan='auto')")


def _check_embedding(model: nn.Module, name: str, module: nn.Module) -> None:
    """What VocabParallel() needs of the module it converts."""
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"parallelize: VocabParallel() needs an nn.Embedding, but {name} is {type(module).__name__}")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(f"parallelize: VocabParallel() supports nn.Embedding without max_norm, scale_grad_by_freq "
                         f"and sparse; {name} sets one of them")
    holders = [f"{n}.{k}" for n, m in model.named_modules() if m is not module
               for k, t in m.named_parameters(recurse=False) if t is module.weight]
    if holders:
        raise ValueError(f"parallelize: VocabParallel() on {name} would untie it from {holders}, which hold its weight "
                         "as their own parameter (a tied head); leave the embedding replicated, or have the head read "
                         "the embedding module through tensor_parallel.tied_logits (Note [vocab-parallel head])")
    if problem := subclass_problem(module):
        raise ValueError(f"parallelize: {name}: {problem}")


def _convert_embedding(model: nn.Module, name: str, module: nn.Module, spec: VocabParallel, tp_group) -> None:
    """VocabParallel(): replace the embedding wherever the model holds it (a tied head holds it too)."""
    layer = VocabParallelEmbedding.from_embedding(module, sequence_parallel=spec.sequence_parallel, tp_group=tp_group)
    for parent in model.modules():
        for child, m in list(parent.named_children()):
            if m is module:
                setattr(parent, child, layer)


def _check_fused_activation(model: nn.Module, name: str, module: nn.Module, targets: dict) -> None:
    """"fused" names an nn.GELU that a Column(activation=...) in the same parent applies."""
    parent_name, _, _ = name.rpartition(".")
    approximate = getattr(module, "approximate", None)
    fused_by = [n for n, spec in targets.items() if n.rpartition(".")[0] == parent_name and isinstance(spec, Column)
                and _GELU_APPROXIMATE.get(spec.activation) == approximate]
    if not isinstance(module, nn.GELU) or not fused_by:
        raise ValueError(f"parallelize: plan names {name} ({type(module).__name__}) 'fused', but "
                         f"{parent_name or type(model).__name__} has no Column(activation=...) layer that applies it; "
                         "'fused' is for an nn.GELU whose approximation a sibling Column(activation='gelu' or "
                         "'gelu_tanh') applies")
