"""Sequence parallelism for Hugging Face decoders, whose activations are [batch, seq, hidden].

    tensor_parallel.parallelize(model, tp_group=ctx.tp_group, sequence_parallel=True)

Megatron's sequence parallelism (Korthikanti et al., 2022): between the tensor-parallel
regions - the residual stream, the norms - each rank of the TP group holds seq / tp positions
of the sequence instead of all of them; every region (attention, MLP) gathers the sequence at
its entry and its row layers reduce-scatter it back at its exit, in place of their all-reduce.
Same communication volume as plain TP (an all-reduce is a reduce-scatter + an all-gather),
1 / tp of the activation memory and of the norm / residual compute outside the regions. The
sequence is dim 1 here (`SEQ_DIM`); the layers and collectives take it as `seq_dim` (comm.py,
Note [strided sequence chunks]).

Note [hf sequence parallel boundaries]: where the sequence is split and gathered, read off the
forward of each supported family (transformers 5.23, `FAMILIES`):

  - Split at the input of the first decoder layer (a forward pre-hook), not at the embedding:
    the base model's forward computes position ids / cache positions, the rotary cos / sin
    (Llama family) or adds the learned positions (GPT-2), and builds the causal mask, all from
    the embedding output's sequence length, before the first layer. Splitting later keeps them
    full-length; the layers receive them as arguments and hand them to attention untouched.
    Backward of the split: all-gather (the embedding above is replicated compute). A
    vocabulary-parallel embedding (VocabParallelEmbedding: each rank looks up the ids of its
    rows, zeros elsewhere) does not all-reduce its partial sums when the family's forward hands
    its output to layer 0 as it is (Llama, Mistral, Qwen2, ...: `_EMBEDDING_FEEDS_LAYER_0`; between
    the two, only the output's shape, dtype and device are read, for the positions, the mask
    and the rotary cos / sin): layer 0's entry reduce-scatters them on the sequence instead, as
    Megatron's embedding does - one reduce-scatter where plain TP all-reduces and then drops
    (tp - 1) / tp of the result; backward all-gathers the gradient, which every rank's lookup
    then reads whole. GPT-2 adds the learned positions to the output first (a sum of partial
    sums would count them tp times), so its vocabulary-parallel embedding all-reduces.
  - Gather at the entry of each region - the module that holds the column layers, `self_attn`
    / `mlp` (Llama family), `attn` / `mlp` (GPT-2) - with a forward pre-hook: attention reads
    the sequence length from its input (`input_shape = hidden_states.shape[:-1]`) to shape its
    heads, so it must see the whole sequence; it then applies the full-length rotary cos / sin
    and mask to the full-length q and k. One all-gather serves every column layer of the region
    (q, k and v read one input), so those layers are `shared_input=True`: no gather of their
    own, and their input gradients stay partial (each rank's heads); the region input is read by
    nothing else in these families, so the gather's backward reduce-scatters the sum. Plain
    tensor parallelism does the same with an all-reduce (Note [one reduction per region]).
  - Exit: the region's row layers (`o_proj` / `down_proj`, GPT-2's `c_proj`s) reduce-scatter on
    the sequence dim instead of all-reducing (backward: all-gather).
  - Inside a region whose plan gathers the column layers' outputs (Phi-3's packed qkv_proj,
    OLMo 2's and OLMoE's q, k, v before their q_norm / k_norm over every head; GLM's, GLM-4's
    and Phi-3's packed gate_up_proj only in an explicit plan that gathers it: the published
    one is split block by block instead, Note [packed MLPs split block by block] in plan.py): the columns all-gather their output features, the region
    runs whole between them and the row layers, which slice their input's features again and
    reduce-scatter on the sequence (Note [gathered regions under sequence parallelism]).
  - Per position, between the regions, on each rank's chunk: the norms before the regions, the
    norms after them (GLM-4's post_self_attn_layernorm / post_mlp_layernorm, OLMo 2's and EXAONE
    4's post-norms) and the residual adds; OLMo 2 has no norm before its regions, which then
    read the layer's input (the residual) directly: the region's entry gathers the argument it
    is passed, and the residual add keeps this rank's chunk.
  - Gather at the output of the final norm (a forward hook): the head computes the logits and
    the loss of the whole sequence on every rank (a replicated head, or the column head that
    gathers its output), so every rank's gradient of the gathered tensor is the whole, same one:
    its backward keeps this rank's chunk (`replicated_consumer=True`); a reduce-scatter would
    multiply it by tp.

What is summed over tp: every replicated parameter of the decoder layers and of the final norm
sees only this rank's positions, so its gradient is a partial sum (`reduce_grad_over_tp`): the
RMSNorm / LayerNorm weights and biases, and the row biases (added after the reduce-scatter;
`RowParallelLinear` registers them itself). Qwen3's per-head `q_norm` / `k_norm` see the whole
sequence but only this rank's heads: a partial sum too, summed once (the plan's Replicated()
registers the same hook, which is registered once per parameter). Not summed: the parameters
left whole inside a region whose column layers gather their outputs (OLMo 2's and OLMoE's
q_norm / k_norm), which see every head of the whole sequence on every rank, whole gradients
already (Note [gathered regions under sequence parallelism]). The column and row weights
(and column biases) see the whole sequence of their own shard and need nothing; the embedding and the head sit outside
the split: replicated compute, or a vocabulary-parallel embedding whose rows' gradient is whole
(it reads the all-gathered gradient of the full sequence).

The sequence length must divide by tp; the split checks it with the input's shape, which every
rank of the TP group shares, so every rank raises the same error. Requirements checked before
anything is converted: a supported family (another family's forward may read the sequence
length elsewhere, so it is refused by name rather than run wrongly), no cross-attention, and
every linear layer of the decoder layers in the plan, the column layers of a region in a module
below the decoder layer (the region) beside its row layers - a linear left replicated would run
on a chunk, or read a gathered input as replicated compute.

Not covered: hidden states recorded with `output_hidden_states=True` are the per-rank chunks
between layers; dropout inside the split draws each rank's mask for its own positions (the
parity tests use none); generation one token at a time cannot split a length of 1.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import _peft
from parallel_layers.tensor_parallel import comm
from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, SwiGLUMLP, reduce_grad_over_tp
from parallel_layers.tensor_parallel.vocab import VocabParallelEmbedding

SEQ_DIM = 1  # [batch, seq, hidden]

# model_type -> (decoder layer list, final norm), attribute names on the base model; each one's
# forward read (Note [hf sequence parallel boundaries]) and parity-tested
# (tests/tensor_parallel/test_sequence_parallel_hf.py).
FAMILIES = {
    "llama": ("layers", "norm"),
    "mistral": ("layers", "norm"),
    "qwen2": ("layers", "norm"),
    "qwen3": ("layers", "norm"),  # Qwen2's model and decoder layer; q_norm / k_norm in attention
    "gpt2": ("h", "ln_f"),
    # Llama's model forward (diffed, transformers 5.23) and decoder layers whose only other ops are
    # per-position: Gemma's (1 + weight) RMSNorm, OLMo's clip_qkv clamp inside attention and its
    # parameter-free LayerNorm, Nemotron's LayerNorm1P, SmolLM3's no-RoPE layers, EXAONE 4's
    # norms after attention and MLP and its q / k norms.
    "gemma": ("layers", "norm"), "olmo": ("layers", "norm"), "nemotron": ("layers", "norm"),
    "smollm3": ("layers", "norm"), "exaone4": ("layers", "norm"),
    # Gemma 2 and Gemma 3: Gemma's model forward but for a mask per layer type (and Gemma 3 a
    # rotary table per type), both built before layer 0; decoder layers with four per-position
    # norms (before and after attention and the MLP); the attention's score soft-capping is
    # elementwise on the whole sequence's scores; Gemma 3's q_norm / k_norm are per head, as
    # Qwen3's. The logits' soft-capping comes after the head, outside the split.
    "gemma2": ("layers", "norm"), "gemma3_text": ("layers", "norm"),
    # mixtures of experts with Mistral's model forward (Note [experts under sequence parallelism])
    "mixtral": ("layers", "norm"), "qwen3_moe": ("layers", "norm"),
    # Regions whose published plans gather the column layers' outputs (Note [gathered regions
    # under sequence parallelism]); model forwards diffed against Llama's (GLM, GLM-4, OLMo 2:
    # identical) or Mistral's (Phi-3: identical; its sliding-window mask built before layer 0).
    # GLM: Llama's decoder layer and attention (partial rotary: the cos / sin cover part of each
    # head, built before layer 0); its MLP computes gate_up_proj, then chunk(2) of its output
    # features, which is why its plan gathers them, and down_proj splits its input again (we
    # split gate_up_proj block by block instead: Note [packed MLPs split block by block]).
    # GLM-4: GLM's, plus post_self_attn_layernorm / post_mlp_layernorm on the regions' outputs,
    # per position, before the residual adds.
    # Phi-3: q, k, v packed in qkv_proj, its output sliced at config.num_attention_heads *
    # head_dim (the whole model's heads), so its plan gathers it and attention runs every head on
    # every rank; the MLP is GLM's; a residual dropout per region (the tests use none).
    # OLMo 2: no norm before the regions - attention and the MLP read the layer's input and the
    # attention's residual sum, which the residual adds read too (the region's entry gathers the
    # argument, the residual keeps the chunk) - and post-norms on their outputs; q_norm /
    # k_norm normalise over every head's features, so its plan gathers q, k, v.
    "glm": ("layers", "norm"), "glm4": ("layers", "norm"), "phi3": ("layers", "norm"),
    "olmo2": ("layers", "norm"),
    # OLMoE: Mixtral's model forward without the sliding-window mask, Llama's decoder layer;
    # attention as OLMo 2's (q_norm / k_norm over every head, its plan gathers q, k, v) with
    # OLMo's clip_qkv clamp, per element; its MoE block returns the experts' output, reshaped.
    "olmoe": ("layers", "norm"),
    # Qwen2-MoE: Qwen3-MoE's model forward (a full and a sliding-window mask, both built before
    # layer 0), Llama's decoder layer, Qwen2's attention (biases on q, k, v); dense MLP layers
    # (mlp_only_layers, decoder_sparse_step) are SwiGLU regions; its MoE block adds a shared
    # expert, gated per token, to the experts' output (Note [a shared expert under sequence
    # parallelism]).
    "qwen2_moe": ("layers", "norm"),
}
# model_type -> what its MoE block returns: the experts' output, reshaped to [batch, seq,
# hidden], and nothing added (read in transformers 5.23).
_EXPERTS_BLOCK_RETURNS_EXPERTS = ("mixtral", "qwen3_moe", "olmoe")
# model_type -> (shared expert, its gate): modules of a MoE block that returns the experts' output
# plus sigmoid(gate(x)) * shared_expert(x), both reading the block's input (read in transformers
# 5.23; Note [a shared expert under sequence parallelism]).
_SHARED_EXPERT = {"qwen2_moe": ("shared_expert", "shared_expert_gate")}
# model_type -> the base model's input embedding, for the families whose forward passes its
# output to decoder layer 0 unchanged (Note [hf sequence parallel boundaries]).
_EMBEDDING_FEEDS_LAYER_0 = {"llama": "embed_tokens", "mistral": "embed_tokens", "qwen2": "embed_tokens",
                            "qwen3": "embed_tokens", "olmo": "embed_tokens", "nemotron": "embed_tokens",
                            "smollm3": "embed_tokens", "exaone4": "embed_tokens", "mixtral": "embed_tokens",
                            "qwen3_moe": "embed_tokens", "glm": "embed_tokens", "glm4": "embed_tokens",
                            "phi3": "embed_tokens", "olmo2": "embed_tokens", "olmoe": "embed_tokens",
                            "qwen2_moe": "embed_tokens"}
# Not Gemma: its embedding scales the rows in its own forward (an nn.Embedding subclass, Note
# [nn.Embedding subclasses]); a vocabulary-parallel one all-reduces before that forward sees them.


@dataclasses.dataclass(frozen=True)
class Layout:
    """Module names (as in `model.named_modules()`) of the decoder layers and the final norm."""

    layers: tuple[str, ...]
    final_norm: str
    embedding: str | None = None  # whose output reaches layers[0] unchanged, if the family's does

    def holds(self, name: str) -> bool:
        """Is `name` a module inside a decoder layer (where the sequence is split)?"""
        return any(name.startswith(layer + ".") for layer in self.layers)


def find_layout(model: nn.Module) -> Layout:
    """The decoder layers and final norm of a supported family; refuses anything else."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"parallelize: sequence_parallel=True supports the Hugging Face decoders whose forward was "
                         f"checked for it, model_type in {sorted(FAMILIES)}; {type(model).__name__} has model_type "
                         f"{family!r}. Use sequence_parallel=False (plain tensor parallelism) for it")
    if getattr(config, "output_router_logits", False):  # Note [experts under sequence parallelism]
        raise ValueError(f"parallelize: sequence_parallel=True does not support the routers' load-balancing loss "
                         f"({type(model).__name__} has config.output_router_logits=True): its gradient reaches every "
                         f"rank's router whole, where sequence parallelism sums the routers' gradients over tp. Set "
                         f"model.config.output_router_logits = False, or use sequence_parallel=False")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"parallelize: sequence_parallel=True does not support cross-attention "
                         f"({type(model).__name__} has config.add_cross_attention=True): the encoder states are not "
                         "split on the sequence")
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, model) if prefix else model
    base_name = prefix if base is not model else ""
    layers_attr, norm_attr = FAMILIES[family]
    layers, norm = getattr(base, layers_attr, None), getattr(base, norm_attr, None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not isinstance(norm, nn.Module):
        raise ValueError(f"parallelize: sequence_parallel=True expects {type(model).__name__} ({family}) to hold its "
                         f"decoder layers in {_join(base_name, layers_attr)} (a non-empty nn.ModuleList) and its final "
                         f"norm in {_join(base_name, norm_attr)}, as transformers builds it")
    embedding = _EMBEDDING_FEEDS_LAYER_0.get(family)
    return Layout(tuple(_join(base_name, layers_attr, str(i)) for i in range(len(layers))),
                  _join(base_name, norm_attr), _join(base_name, embedding) if embedding else None)


def known_layout(model: nn.Module) -> Layout | None:
    """find_layout's answer for a supported family without cross-attention, None (no error) for
    anything else."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "add_cross_attention", False):
        return None
    try:
        return find_layout(model)
    except ValueError:  # not built as transformers builds the family
        return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def check_plan(model: nn.Module, layout: Layout, targets: dict, is_column, is_row, is_experts=lambda spec: False,
               gathers=lambda spec: False) -> None:
    """Before any conversion: every linear of the decoder layers is in the plan, and each column
    layer's parent (its region) sits below the decoder layer and holds row layers too; an
    Experts() module sits in a MoE block whose output is its own (Note [experts under sequence
    parallelism]); a region holding parameters left whole gathers the outputs of all its column
    layers or of none (`gathers`: a column spec that gathers its output; Note [gathered regions
    under sequence parallelism])."""
    modules = dict(model.named_modules())
    family = getattr(getattr(model, "config", None), "model_type", None)
    shared = []  # shared experts and their gates: whole (Note [a shared expert under sequence parallelism])
    for name, spec in targets.items():
        if layout.holds(name) and is_experts(spec):
            parent = name.rpartition(".")[0]
            if family not in (*_EXPERTS_BLOCK_RETURNS_EXPERTS, *_SHARED_EXPERT) or parent in layout.layers:
                raise ValueError(f"parallelize: sequence_parallel=True splits the experts of a MoE block whose output "
                                 f"is theirs alone, in model_type {list(_EXPERTS_BLOCK_RETURNS_EXPERTS)}, or theirs "
                                 f"plus a gated shared expert's, in {list(_SHARED_EXPERT)}; {name} is in "
                                 f"{type(model).__name__} (model_type {family!r}). Use sequence_parallel=False")
            shared += [f"{parent}.{child}" for child in _SHARED_EXPERT.get(family, ())]
    inside_shared = [n for n in targets if any(n == m or n.startswith(m + ".") for m in shared)]
    if inside_shared:
        raise ValueError(f"parallelize: sequence_parallel=True keeps a MoE block's shared expert and its gate whole "
                         f"(they read the block's gathered input, [tokens, hidden]); the plan names {inside_shared[:4]}"
                         f". Leave them out of the plan, or use sequence_parallel=False")
    for name, module in modules.items():
        if any(name == m or name.startswith(m + ".") for m in shared):
            continue  # whole, by design (Note [a shared expert under sequence parallelism])
        inside_target = any(name.startswith(t + ".") for t in targets)  # a LoRA layer's base and adapters
        if layout.holds(name) and _is_linear(module) and name not in targets and not inside_target:
            raise ValueError(f"parallelize: sequence_parallel=True needs every linear layer of the decoder layers in "
                             f"the tensor-parallel plan (attention and MLP run on the gathered sequence between a "
                             f"column and a row layer); {name} ({type(module).__name__}) is not in it")
    regions, gathered = {}, {}
    for name, spec in targets.items():
        if not layout.holds(name):
            continue
        parent = name.rpartition(".")[0]
        if is_column(spec):
            if parent in layout.layers:
                raise ValueError(f"parallelize: sequence_parallel=True gathers the sequence at the module holding "
                                 f"the column layers (attention, MLP); {name} sits directly in the decoder layer "
                                 f"{parent}, whose input is the split sequence")
            regions.setdefault(parent, [0, 0])[0] += 1
            gathered.setdefault(parent, {})[name] = bool(gathers(spec))
        elif is_row(spec):
            regions.setdefault(parent, [0, 0])[1] += 1
    for region, (columns, rows) in regions.items():
        if not columns or not rows:
            raise ValueError(f"parallelize: sequence_parallel=True needs each region ({region}) to hold both its "
                             f"column layers (which read the gathered sequence) and its row layers (which "
                             f"reduce-scatter it); {region} has {columns} column and {rows} row layer(s) in the plan")
    for region, columns in gathered.items():
        whole = [n for n, p in model.named_parameters() if n.startswith(region + ".")
                 and not any(n.startswith(t + ".") for t in targets)]
        if whole and len(set(columns.values())) > 1:
            raise ValueError(f"parallelize: sequence_parallel=True sums the gradients of the parameters left whole "
                             f"in a region whose column layers keep their outputs split (they see this rank's "
                             f"heads), and not in one whose column layers all gather them (they see everything); "
                             f"{region} holds {whole[:4]} and gathers the outputs of "
                             f"{[n for n, g in columns.items() if g]} but not of "
                             f"{[n for n, g in columns.items() if not g]}. Gather all of them or none")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def apply(model: nn.Module, layout: Layout, tp_group: dist.ProcessGroup | None) -> None:
    """After conversion: the split, the gathers and the gradient sums of Note [hf sequence
    parallel boundaries]."""
    modules = dict(model.named_modules())
    first = modules[layout.layers[0]]
    embedding = modules.get(layout.embedding) if layout.embedding else None
    partial = isinstance(embedding, VocabParallelEmbedding) and comm.group_size(tp_group) > 1
    if partial:  # its partial sums are reduce-scattered at layer 0 (Note [hf sequence parallel boundaries])
        embedding.partial_output = True
    first.register_forward_pre_hook(
        _on_hidden_states(lambda x: _split(x, tp_group, layout.layers[0], partial, first)), with_kwargs=True)
    # the end of a forward that ran without the split (Note [a forward without the sequence split]):
    # at the end of every module around layer 0 a user may call, the decoder (model.model) too,
    # whose direct call otherwise left the flag on for the process's other sequence-parallel
    # layers (review finding)
    names = layout.layers[0].split(".")
    for outer in {".".join(names[:i]) for i in range(len(names))}:
        modules[outer].register_forward_hook(lambda m, args, out: comm.set_whole_sequence(False), always_call=True)
    for region in sorted(_regions(modules, layout)):
        modules[region].register_forward_pre_hook(
            _on_hidden_states(lambda x: comm.gather_from_sp(x, tp_group, SEQ_DIM)), with_kwargs=True)
    family = getattr(getattr(model, "config", None), "model_type", None)
    tp = comm.group_size(tp_group)
    whole = {id(p) for region in _gathered_regions(modules, layout) for p in modules[region].parameters()}
    for block in sorted(_experts_blocks(modules, layout)):  # Note [experts under sequence parallelism]
        modules[block].register_forward_pre_hook(
            _on_hidden_states(lambda x: comm.gather_from_sp(x, tp_group, SEQ_DIM)), with_kwargs=True)
        modules[block].register_forward_hook(lambda m, args, out: comm.reduce_scatter_to_sp(out, tp_group, SEQ_DIM))
        if family in _SHARED_EXPERT and tp > 1:  # Note [a shared expert under sequence parallelism]
            shared_expert = modules[f"{block}.{_SHARED_EXPERT[family][0]}"]
            shared_expert.register_forward_pre_hook(_on_hidden_states(lambda x: _ScaleGrad.apply(x, 1 / tp)),
                                                    with_kwargs=True)
            shared_expert.register_forward_hook(lambda m, args, out: _ScaleValue.apply(out, 1 / tp))
            whole |= {id(p) for p in shared_expert.parameters()}
    modules[layout.final_norm].register_forward_hook(
        lambda m, args, out: comm.gather_from_sp(out, tp_group, SEQ_DIM, replicated_consumer=True))
    for name in (*layout.layers, layout.final_norm):
        for p in modules[name].parameters():
            # replicated: norms, row biases, routers, a shared expert's gate (Note [hf sequence
            # parallel boundaries]); not the parameters of a region that gathers its columns'
            # outputs, which see everything (the row biases there sum themselves: Note [gathered
            # regions under sequence parallelism]), nor a shared expert's, whole (Note [a shared
            # expert under sequence parallelism])
            if not hasattr(p, "tp_shard") and id(p) not in whole:
                reduce_grad_over_tp(p, tp_group)
    model._pl_sequence_parallel = layout  # read by the tests and by repr-level inspection


def regions(modules: dict, layout: Layout) -> list[str]:
    """Every module inside the decoder layers whose entry gathers the sequence: the regions
    holding column layers and the MoE blocks."""
    return sorted({*_regions(modules, layout), *_experts_blocks(modules, layout)})


def replicated_regions(modules: dict, layout: Layout) -> list[str]:
    """The regions that compute whole on every rank: those whose column layers gather their
    outputs, and the MoE blocks (their routers read the gathered tokens)."""
    return sorted({*_gathered_regions(modules, layout), *_experts_blocks(modules, layout)})


def _regions(modules: dict, layout: Layout) -> dict[str, list[ColumnParallelLinear]]:
    """Region name -> its column layers: the modules inside the decoder layers that hold
    column layers as children."""
    regions: dict[str, list[ColumnParallelLinear]] = {}
    for name, m in modules.items():
        if layout.holds(name) and isinstance(m, ColumnParallelLinear):
            parent = name.rpartition(".")[0]
            if name.endswith(".base_layer") and _peft.is_lora_layer(modules[parent]):
                parent = parent.rpartition(".")[0]  # a split LoRA layer's base: its region is the layer's
            regions.setdefault(parent, []).append(m)
    return regions


# Note [gathered regions under sequence parallelism]: some families' published plans gather a
# region's column outputs ("colwise_gather_output") and split its row layers' inputs again
# ("rowwise_split_input"), because the region's forward reads features across the heads or
# the shards: GLM's, GLM-4's and Phi-3's MLPs chunk(2) gate_up_proj's output (which
# plan.published_plan splits block by block instead, so that the chunk is each rank's own:
# Note [packed MLPs split block by block]), Phi-3's attention slices qkv_proj's at the model's
# head count, OLMo 2's (and OLMoE's) q_norm / k_norm normalise
# over every head's features. Between such column and row layers every rank then computes the
# region whole: every head or feature, of the whole sequence (plain tensor parallelism does the
# same). Under sequence parallelism the region's entry gathers the sequence as for any region;
# the column layers stay shared_input (no collective on their input, input gradient partial)
# and all-gather their output features (backward: keep this rank's features, as the consumers
# after them are replicated); the row layers take this rank's slice of their whole input's
# features, and reduce-scatter on the sequence (RowParallelLinear(input_is_parallel=False,
# sequence_parallel=True); backward: all-gather on the sequence, then on the features, giving
# every rank the whole input gradient). The parameters left whole between them (OLMo 2's
# q_norm / k_norm, a row bias apart) see the whole sequence and every feature on every rank:
# their gradients are whole and alike, and are NOT summed over tp (summing would multiply them
# by tp) - unlike Qwen3's per-head q_norm, which sees this rank's heads only. A region whose
# column layers gather some outputs and not others, holding such parameters, is refused
# (check_plan): which of them see everything would depend on which column they read.
def _gathered_regions(modules: dict, layout: Layout) -> list[str]:
    """The regions whose column layers all gather their outputs (Note [gathered regions under
    sequence parallelism])."""
    return sorted(region for region, columns in _regions(modules, layout).items()
                  if all(column.gather_output for column in columns))


# Note [experts under sequence parallelism]: a MoE block (Mixtral's, Qwen3-MoE's, OLMoE's) is a
# region too: its router and its experts (tensor_parallel/experts.py) read the block's input, and
# it returns the experts' output, reshaped (Qwen2-MoE's adds a shared expert's: Note [a shared
# expert under sequence parallelism]). Its entry gathers the sequence, as attention's does;
# its output, the experts' partial sums over this rank's intermediate features, is
# reduce-scattered on the sequence by a forward hook on the block (not inside the experts, whose
# [tokens, hidden] rows are batch-major: a split of them is not a split of the sequence). The
# experts then need no collective of their own. In the backward the gather reduce-scatters the
# sum of what the block's input received: the experts' partial input gradients, and the
# router's - partial too, since the routing weights' gradient is left partial (each rank's
# experts' share) and the router is linear in it; the router's weight gradient is a partial sum
# like every replicated parameter of the decoder layers, and summed with them. The router reads
# the gathered, identical sequence on every rank, so routing agrees. The routers' load-balancing
# loss (config.output_router_logits) breaks that bookkeeping: its gradient reaches each rank's
# router logits whole, and would be summed tp times with the partial ones (measured: gradients
# 1.0-1.5 relative off the plain model's). find_layout refuses it.
def _experts_blocks(modules: dict, layout: Layout) -> list[str]:
    """The modules inside the decoder layers that hold tensor-parallel experts."""
    from parallel_layers.tensor_parallel.experts import is_tensor_parallel_experts
    return sorted({name.rpartition(".")[0] for name, m in modules.items()
                   if layout.holds(name) and is_tensor_parallel_experts(m)})


# Note [a shared expert under sequence parallelism]: Qwen2-MoE's block returns experts(x) +
# sigmoid(shared_expert_gate(x)) * shared_expert(x), x its input, gathered on the sequence. The
# experts' output is a partial sum (this rank's slice of every expert's features) and the block's
# hook reduce-scatters the sum of everything the block returns; its published plan leaves the
# shared expert and its gate whole (plain tensor parallelism runs them replicated), so the
# shared term is the same whole value on every rank and would be summed tp times. It stays
# whole - run on the gathered sequence on every rank, as under plain tensor parallelism - and
# two hooks on the shared expert make its term a partial sum with whole gradients:
#   - its output is divided by tp in forward, its gradient passed on as it is (_ScaleValue): the
#     tp shares then sum to the term once; the gradient reaching the shared expert is every
#     rank's same whole one (the reduce-scatter's backward all-gathered it), so its parameters'
#     gradients are whole and alike and are NOT summed over tp;
#   - its input's gradient is divided by tp in backward (_ScaleGrad): whole on every rank, it
#     joins the experts' and the router's partial input gradients, which the block's entry
#     reduce-scatters (summing tp shares of it once).
# The gate's output multiplies the divided term, so the gate's gradient is 1 / tp of the whole on
# every rank: a partial sum, summed over tp with the routers' and the norms'; its input gradient
# likewise, summed by the entry's reduce-scatter. (Dividing by a power-of-2 tp is exact; the tp
# shares are then added in the reduce-scatter's order, as the experts' partial sums are.) The
# cost is plain tensor parallelism's: the shared expert's whole compute on every rank (tp times
# its share), and no collective of its own. Sharding it as a column / row MLP whose row
# layer leaves its partial sums to the block's reduce-scatter would split that compute; the row
# layers here always reduce, and the plan does not name it.
class _ScaleValue(torch.autograd.Function):
    """x * factor forward; the gradient unchanged backward."""

    @staticmethod
    def forward(ctx, x, factor):
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """x forward; the gradient * factor backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


# Note [one reduction per region]: a column layer's input gradient is a partial sum on each
# rank (its slice of the output features), so by itself the layer all-reduces it in backward
# (Megatron's f). Attention's q, k and v read one input: three all-reduces of three partial
# sums that autograd then adds, where one all-reduce of their sum gives the same value - the
# reason Megatron packs them into one QKV layer. Here the modules stay Hugging Face's, so the
# region does it: under plain tensor parallelism, for the families whose forward was read
# (FAMILIES: the region's input reaches nothing but its column layers), a region with several
# column layers and no linear left replicated gets comm.copy_to_tp at its entry (identity
# forward, all-reduce backward) and its column layers shared_input=True. Per Llama-family
# decoder layer the backward's all-reduces go from 4 to 2 (q, k, v -> one; gate and up were
# already one in SwiGLUMLP, which keeps its own, overlapped with its weight-gradient GEMM). What
# it gives up: each column layer's all-reduce was asynchronous, overlapped with its
# weight-gradient GEMM; the region's is waited for at once (the norm before it needs the sum).
# Sequence parallelism's region gather is the same idea (Note [hf sequence parallel
# boundaries]). A region that holds a replicated linear is left alone: if that linear read the
# region's input, its whole gradient would be summed tp times.
def share_region_inputs(model: nn.Module, layout: Layout, tp_group: dist.ProcessGroup | None) -> list[str]:
    """Plain tensor parallelism: one input-gradient all-reduce per region whose column layers
    share its input (Note [one reduction per region]); returns the regions' names."""
    modules = dict(model.named_modules())
    shared = []
    for region, columns in sorted(_regions(modules, layout).items()):
        module = modules[region]
        replicated = [n for n, m in module.named_children() if _is_linear(m)]
        if len(columns) < 2 or isinstance(module, SwiGLUMLP) or replicated:
            continue
        for layer in columns:
            layer.shared_input = True
        module.register_forward_pre_hook(_on_hidden_states(lambda x: comm.copy_to_tp(x, tp_group)),
                                         with_kwargs=True)
        shared.append(region)
    return shared


def _on_hidden_states(fn):
    """A forward pre-hook (with kwargs) replacing the module's hidden states - its first
    positional argument, or the `hidden_states` keyword as Llama-family layers pass it."""
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TypeError(f"sequence parallelism: {type(module).__name__} was called without hidden states (no "
                        f"positional argument, no hidden_states=); got keywords {sorted(kwargs)}")
    return hook


def _split(x: Tensor, tp_group, layer_name: str, partial: bool, layer: nn.Module | None = None) -> Tensor:
    """This rank's chunk of the sequence: of `x`, or, when `x` is each rank's partial sum (a
    vocabulary-parallel embedding's output), of their sum."""
    tp = comm.group_size(tp_group)
    if x.dim() != 3:
        raise ValueError(f"sequence parallelism splits dim {SEQ_DIM} of the [batch, seq, hidden] hidden states "
                         f"entering {layer_name}, but they have shape {tuple(x.shape)}")
    seq = x.shape[SEQ_DIM]
    # under a pipeline every stage reads the split hidden states: none can run the forward
    # unsplit alone (Note [sequence parallelism across stages] in pipeline/hf.py)
    strict = getattr(layer, "_pl_pipelined_split", False)
    # a forward without gradients runs any length as plain TP (Note [a forward without the
    # sequence split] in comm.py); set for every forward, so none inherits a previous one's
    comm.set_whole_sequence(bool(seq % tp) and not torch.is_grad_enabled() and not strict)
    if seq % tp and (torch.is_grad_enabled() or strict):
        below, above = seq // tp * tp, (seq // tp + 1) * tp
        valid = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"sequence parallelism splits the sequence over the tensor-parallel group: the hidden states "
                         f"entering {layer_name} have shape {tuple(x.shape)} ([batch, seq, hidden]), and a sequence "
                         f"length of {seq} does not divide by tp={tp}; valid lengths are multiples of {tp} (the "
                         f"nearest: {valid}). Pad the batch (labels -100 on the padding) or parallelize with "
                         "sequence_parallel=False. (A forward without gradients - evaluate, generate() - takes any "
                         "length: it runs as plain tensor parallelism; not under a pipeline, whose stages all read "
                         "the split.)")
    if partial:
        return comm.reduce_scatter_to_sp(x, tp_group, SEQ_DIM)
    return comm.scatter_to_sp(x, tp_group, SEQ_DIM)
