"""Pipeline an unmodified Hugging Face decoder: its own modules as a layer list.

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    par = parallelize(model, ctx, optimizer=..., loss_fn=causal_lm_loss, pipeline_layers="auto", microbatches=4)
    loss = par.forward_backward(input_ids, input_ids)   # labels as for model(input_ids, labels=...): shifted here

`decoder_layers(model)` returns [embedding, decoder layer 0, ..., decoder layer L-1, final
norm + head], each taking one tensor and returning one, as `PipelineStages` needs: token ids
[batch, seq] -> hidden states [batch, seq, hidden] -> ... -> logits [batch, seq, vocab]. The
pieces are the model's own modules (no copy, no new parameter), so TP applied to the model
before the cut, `from_pretrained` weights and tied embeddings all carry over.

Note [hf pipeline layers]: a decoder layer needs more than the hidden states: position ids,
the rotary cos/sin (Llama family) and the causal mask. The stage boundary carries one tensor
(Note [stage boundary contract] in _p2p.py), so each layer rebuilds them from the hidden
states' sequence length, as the model's own forward builds them once: position ids
arange(seq), cos/sin from the model's `rotary_emb`, the mask from transformers'
`create_causal_mask` (or `create_sliding_window_causal_mask` where the family's forward picks
it for that layer). That costs a few elementwise ops per layer, far less than the attention
it feeds, and sends nothing. A padded batch's
attention mask [batch, seq] goes to every decoder layer as a side input (Note [side inputs] in
stages.py: `par.forward_backward(input_ids, labels, attention_mask=mask)`, sent once per step
from pipeline rank 0), and the layer builds the model's mask from it; positions are
arange(seq), as the model's forward makes them without position ids, unless the user gives
`position_ids=` (left padding under GPT-2's learned positions, packed sequences): they are a
side input too, read by GPT-2's embedding and by every decoder layer (its rotary cos/sin, and
its mask: with no attention mask, transformers' mask code reads restarting positions as packed
documents and keeps attention within each, as the unpipelined step does, Note [no cache in a
training step] in parallelize.py). For the
loss of a padded batch, `causal_lm_loss_sum` with `token_count=causal_lm_tokens` gives the
batch's mean over its labelled tokens however they fall into microbatches (labels -100 at
the padding, as for `model(input_ids, attention_mask=..., labels=...)`). Inputs that are not
token ids [batch, seq] are refused on every pipeline rank before the step
(`pipeline_input_problem`, read by the runtime's batch check).

Note [sequence parallelism across stages]: under sequence parallelism (tensor_parallel/
hf_sequence_parallel.py) the residual stream between decoder layers is each tensor-parallel
rank's chunk of the sequence: split entering layer 0, gathered leaving the final norm. A stage
boundary then carries the chunk ([microbatch, seq / tp, hidden]: 1 / tp of the bytes, as
Megatron-LM sends it), whose shape the boundary learns as any other (Note [stage boundary
contract] in _p2p.py). A decoder layer after the first reads the chunk, so it builds its
positions, rotary cos/sin and causal mask for tp times its length - the whole sequence the
layer's attention gathers - not for the chunk (`split_sequence` gives those layers the
tensor-parallel group). A forward without gradients of a length tp does not divide cannot run
unsplit as without a pipeline (Note [a forward without the sequence split] in comm.py): the
later stages would not know; the split refuses it under a pipeline (every rank raises, as for a
failed stage).

Each adapter mounts the modules it runs under their paths in the model (`_mount`), so its
state_dict keys are the model's own ("model.layers.3.mlp.up_proj.weight"), and
`PipelineStages(..., named_after=model)` keeps those keys as the checkpoint names (Note
[pipeline names] in stages.py): checkpoints and `hf.save_pretrained` from the pipelined
layout use the Hugging Face names. A head tied to the input embedding is the same parameter
in the first and the last adapter, which `PipelineStages` ties across ranks (Note [tied
parameters]).

Families: the forward of each supported `model_type` was read and its parity tested
(tests/hf/test_pipeline_hf.py); another family's forward may do more (Phi-1/2's applies a
dropout to the embeddings, others add cross-attention), so it is refused by name rather than
run wrongly.
The choice follows torchtitan / PiPPy in cutting at module boundaries (torchtitan deletes the
modules a stage does not own from a model written to tolerate that; a Hugging Face forward is
not, hence adapters that call the modules as its forward does).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from parallel_layers import _peft

# model_type -> how its forward calls the decoder layers: "llama" (rotary position_embeddings,
# one causal mask or one per config.layer_types entry) or "gpt2" (learned positions added to
# the embedding); and which mask each layer gets (Note [hf pipeline layers]).
# The other Llama-style families' forwards (transformers 5.23) are Llama's, the mask rule aside:
# Gemma scales its rows inside its embedding module, which the adapter calls; SmolLM3's no-RoPE
# layers and the others' per-layer differences are inside their decoder layers.
_LLAMA_STYLE = {"llama": "causal", "mistral": "sliding_window_if_set", "qwen2": "layer_types", "qwen3": "layer_types",
                "gemma": "causal", "olmo": "causal", "olmo2": "causal", "glm4": "causal", "nemotron": "causal",
                "phi3": "sliding_window_if_set", "smollm3": "layer_types", "exaone4": "layer_types",
                "granite": "causal", "cohere": "causal",
                # Gemma 2 and 3: their embedding modules scale the rows, their attention soft-caps
                # the scores (inside the layer); their causal LMs soft-cap the logits (the Head
                # below) and Gemma 3 keeps a rotary table per layer type (`_ROTARY_PER_LAYER_TYPE`)
                "gemma2": "layer_types", "gemma3_text": "layer_types",
                # mixtures of experts: Mistral's (Mixtral, Qwen3-MoE), Qwen2's (Qwen2-MoE) and Llama's
                # (OLMoE) model forwards; their causal LMs add the routers' load-balancing loss only
                # with config.output_router_logits, refused below
                "mixtral": "sliding_window_if_set", "qwen3_moe": "sliding_window_if_set", "qwen2_moe": "layer_types",
                "olmoe": "causal"}
# Llama's forwards but for scalars from the config: Granite multiplies the embeddings by
# embedding_multiplier (its model's forward) and divides the logits by logits_scaling, Cohere
# multiplies the logits by logit_scale (their causal LMs' forwards); the adapters do the same, in
# the same order.
_EMBEDDING_MULTIPLIER = {"granite": "embedding_multiplier"}
_LOGITS_SCALE = {"granite": ("logits_scaling", "divide"), "cohere": ("logit_scale", "multiply")}
# The causal LMs that soft-cap the logits after the head, cap * tanh(logits / cap), with the
# config's final_logit_softcapping (None: not capped).
_LOGITS_SOFTCAP = {"gemma2", "gemma3_text"}
# The families whose rotary module takes the layer's type (Gemma 3: another base frequency for
# the sliding-window layers), the model's forward building one table per type.
_ROTARY_PER_LAYER_TYPE = {"gemma3_text"}
SUPPORTED = sorted([*_LLAMA_STYLE, "gpt2"])


def _mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under the dotted `path` of `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    node.add_module(leaf, module)


class _Layer(nn.Module):
    """One entry of the layer list; children mounted at the model's own paths."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.config = model.config  # not a module: read by the mask functions

    def extra_repr(self) -> str:
        return f"model_type={self.config.model_type!r}"


def _positions(hidden: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """The user's position ids (a side input, Note [side inputs] in stages.py), else those of a
    full sequence, as the model's forward builds them without a cache."""
    if position_ids is not None:
        return position_ids.to(hidden.device)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask(config, kind: str, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    return fn(config=config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
              position_ids=position_ids)


class Embedding(_Layer):
    """Token ids [batch, seq] -> hidden states (GPT-2: plus learned positions, then dropout)."""

    def __init__(self, model: nn.Module, base: str, gpt2: bool):
        super().__init__(model)
        self.gpt2, self.base = gpt2, base
        names = ("wte", "wpe", "drop") if gpt2 else ("embed_tokens",)
        for name in names:
            _mount(self, f"{base}.{name}", model.get_submodule(f"{base}.{name}"))

    pipeline_side_inputs = ("position_ids",)  # GPT-2's learned positions read them

    @property
    def pipeline_vocab_size(self) -> int:
        """Rows of the input embedding: the pipeline's batch check refuses ids outside them on
        every rank (Note [token ids in range] in parallel_layers/_token_ids.py)."""
        return self.get_submodule(f"{self.base}.{'wte' if self.gpt2 else 'embed_tokens'}").num_embeddings

    def forward(self, ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        m = self.get_submodule(self.base)
        if not self.gpt2:
            hidden = m.embed_tokens(ids)
            multiplier = _EMBEDDING_MULTIPLIER.get(self.config.model_type)
            return hidden * getattr(self.config, multiplier) if multiplier else hidden
        hidden = m.wte(ids)
        return m.drop(hidden + m.wpe(_positions(hidden, position_ids)).to(hidden.device))

    def pipeline_input_problem(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why the pipeline's inputs cannot go through this model, or None (every rank asks)."""
        if len(shape) != 2 or dtype not in (torch.int64, torch.int32):
            return (f"a pipelined {type(self.config).__name__[:-6] or 'Hugging Face'} decoder takes token ids "
                    f"[batch, seq] (int64) as the pipeline's inputs; got shape {list(shape)} and dtype {dtype}. "
                    "A padded batch's mask goes separately: forward_backward(input_ids, labels, attention_mask=mask)")
        limit = getattr(self.config, "max_position_embeddings", None) if self.gpt2 else None
        if limit is not None and shape[1] > limit:
            return (f"sequence length {shape[1]} is longer than the model's max_position_embeddings={limit} "
                    "(learned absolute positions); use at most that many tokens")
        return None


class DecoderLayer(_Layer):
    """One decoder layer; rebuilds position ids, rotary cos/sin and the mask (Note [hf pipeline layers])."""

    # a padded batch's [batch, seq] mask, the user's positions (Note [side inputs])
    pipeline_side_inputs = ("attention_mask", "position_ids")

    def __init__(self, model: nn.Module, base: str, layers: str, index: int, mask_kind: str, gpt2: bool):
        super().__init__(model)
        self.gpt2, self.base, self.path, self.mask_kind = gpt2, base, f"{base}.{layers}.{index}", mask_kind
        self.sequence_group = None  # reads a split sequence (Note [sequence parallelism across stages])
        _mount(self, self.path, model.get_submodule(self.path))
        if not gpt2:  # parameter-free, non-persistent buffers: no state_dict entries
            _mount(self, f"{base}.rotary_emb", model.get_submodule(f"{base}.rotary_emb"))

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        layer = self.get_submodule(self.path)
        whole = hidden  # what positions, masks and rotary tables are built for: the whole sequence
        if self.sequence_group is not None:
            from parallel_layers.tensor_parallel import comm

            seq = hidden.shape[1] * comm.group_size(self.sequence_group)
            whole = hidden[:, :1].expand(hidden.shape[0], seq, *hidden.shape[2:])
        position_ids = _positions(whole, position_ids)
        mask = _mask(self.config, self.mask_kind, whole, position_ids, attention_mask)
        if self.gpt2:
            out = layer(hidden, None, mask, None, use_cache=False, position_ids=position_ids)
        else:
            rotary = self.get_submodule(self.base).rotary_emb
            cos_sin = (rotary(whole, position_ids, self.mask_kind) if self.config.model_type in _ROTARY_PER_LAYER_TYPE
                       else rotary(whole, position_ids))
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=None,
                        use_cache=False, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mask={self.mask_kind!r}"


class Head(_Layer):
    """Final norm, then the LM head: hidden states -> logits [batch, seq, vocab]."""

    def __init__(self, model: nn.Module, base: str, norm: str):
        super().__init__(model)
        self.norm_path = f"{base}.{norm}"
        _mount(self, self.norm_path, model.get_submodule(self.norm_path))
        _mount(self, "lm_head", model.lm_head)

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(self.get_submodule(self.norm_path)(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None) if self.config.model_type in _LOGITS_SOFTCAP \
            else None
        if cap is not None:  # as the causal LM's forward writes it
            logits = torch.tanh(logits / cap) * cap
        scale = _LOGITS_SCALE.get(self.config.model_type)
        if scale is None:
            return logits
        value = getattr(self.config, scale[0])
        return logits / value if scale[1] == "divide" else logits * value


def split_sequence(model: nn.Module, layers: list[nn.Module], tp_group) -> None:
    """The pipeline layers of a sequence-parallel model (Note [sequence parallelism across
    stages]): the decoder layers after the first read the split sequence, and the split refuses
    a length it cannot divide."""
    layout = getattr(model, "_pl_sequence_parallel", None)
    if layout is None:
        raise ValueError("a sequence-parallel pipeline needs the model's tensor parallelism applied with "
                         "sequence_parallel=True first (parallelize does so)")
    model.get_submodule(layout.layers[0])._pl_pipelined_split = True
    for layer in layers:
        if isinstance(layer, DecoderLayer) and layer.path != layout.layers[0]:
            layer.sequence_group = tp_group


def _mask_kinds(config, family: str, n: int) -> list[str]:
    """The mask each decoder layer gets, as the family's forward chooses it."""
    rule = _LLAMA_STYLE.get(family, "causal")
    if rule == "layer_types":
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    elif rule == "sliding_window_if_set":
        kinds = ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n
    else:
        kinds = ["full_attention"] * n
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"pipeline_layers='auto': {family} layer types {unknown} are not supported; supported: "
                         "'full_attention', 'sliding_attention'")
    return kinds


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """[embedding, decoder layers..., norm + head] of a Hugging Face causal LM (see the module doc)."""
    _peft.refuse_wrapper(model, "pipeline_layers='auto'", "pass its base model, parallelize(peft_model.get_base_model(), "
                         "ctx, pipeline_layers='auto', ...), which holds the adapted layers (Note [peft models])")
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(f"pipeline_layers='auto' cuts a Hugging Face causal LM (…ForCausalLM / …LMHeadModel, "
                         f"with an lm_head) of model_type {SUPPORTED}; got {type(model).__name__} (model_type "
                         f"{family!r}). For another model, pass pipeline_layers= the name of its list of "
                         "one-tensor-in, one-tensor-out layers")
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"pipeline_layers='auto': {type(model).__name__} has config.output_router_logits=True: its "
                         "loss adds the routers' load-balancing loss over every layer's router logits, which the "
                         "stages do not carry (each sends one tensor, the hidden states). Set "
                         "model.config.output_router_logits = False before parallelize (the loss is then the LM "
                         "loss alone, as with the published defaults), or train without a pipeline")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"pipeline_layers='auto': {type(model).__name__} has config.use_bidirectional_attention=True "
                         "(an encoder, as EmbeddingGemma), whose masks the decoder layers do not rebuild; only causal "
                         "language models are supported")
    gpt2 = family == "gpt2"
    base = getattr(model, "base_model_prefix", "") or ("transformer" if gpt2 else "model")
    if gpt2 and getattr(config, "add_cross_attention", False):
        raise ValueError("pipeline_layers='auto': a GPT-2 with add_cross_attention=True needs encoder states, which "
                         "the pipeline does not carry; only decoder-only causal LMs are supported")
    blocks = "h" if gpt2 else "layers"
    n = len(model.get_submodule(f"{base}.{blocks}"))
    kinds = _mask_kinds(config, family, n)
    layers = [Embedding(model, base, gpt2)]
    layers += [DecoderLayer(model, base, blocks, i, kinds[i], gpt2) for i in range(n)]
    layers.append(Head(model, base, "ln_f" if gpt2 else "norm"))
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in model.named_parameters() if id(p) not in inside]
    if outside:  # a module the family's forward does not use as read here: refuse rather than not train it
        raise ValueError(f"pipeline_layers='auto': {type(model).__name__} has parameters outside the embedding, "
                         f"decoder layers, final norm and head: {outside[:3]}; this model is not supported")
    return layers


def _logits(output, labels: Tensor) -> Tensor:
    """The logits of `output` - the last pipeline stage's tensor, or the ModelOutput of a model
    called whole (no pipeline) - checked against the labels' shape."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not isinstance(labels, Tensor) or \
            tuple(labels.shape) != tuple(logits.shape[:2]):
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"causal_lm_loss: needs logits [batch, seq, vocab] and labels [batch, seq] of the same batch "
                         f"and sequence (the labels are the input ids, -100 where not to learn: the loss shifts them "
                         f"itself); got logits {got} and labels "
                         f"{tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__}")
    return logits


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Hugging Face's causal-LM loss: position t predicts labels[t + 1]; the mean over the
    tokens whose label is not -100 (`model(input_ids, labels=labels).loss`), in float32.
    The pipeline averages the microbatches' means: the batch's mean when every microbatch
    counts as many tokens (always, without -100 labels; with padding, use the pair below).
    `logits` may also be the model's ModelOutput (without a pipeline)."""
    logits = _logits(logits, labels)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def causal_lm_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """`causal_lm_loss`'s sum instead of its mean; with `token_count=causal_lm_tokens` the
    pipeline divides by the batch's labelled tokens: Hugging Face's loss of the whole batch."""
    logits = _logits(logits, labels)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def causal_lm_tokens(labels: Tensor) -> Tensor:
    """How many tokens `causal_lm_loss_sum` sums over: the shifted labels that are not -100."""
    return (labels[:, 1:] != -100).sum()


__all__ = ["SUPPORTED", "causal_lm_loss", "causal_lm_loss_sum", "causal_lm_tokens", "decoder_layers"]
