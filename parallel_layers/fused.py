"""Fused kernels for Hugging Face decoders: their modules swapped for fused ones over the same
parameters, so names, checkpoints and exports do not change.

    parallelize(model, ctx, ...)        # fused_kernels=True (the default) calls fuse(model)

What is swapped (Note [fused modules]):
  - a SwiGLU MLP - a module whose forward is Hugging Face's
    `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with a SiLU `act_fn` (Llama, Mistral, Qwen2,
    Qwen3 in transformers 5.23) - becomes `SwiGLUMLP` (tensor_parallel/layers.py): one GEMM
    on the packed [gate; up] weight with the activation in its epilogue (linear_swiglu),
    column-parallel when gate_proj / up_proj are. One whose gate and up are already one packed
    layer, `gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * activation_fn(gate))` with a
    SiLU (Phi-3, GLM, GLM-4), becomes `PackedSwiGLUMLP`: the same GEMM on that one weight,
    column-parallel when gate_up_proj is split block by block.
  - an RMSNorm of the Llama form - a forward that is Hugging Face's LlamaRMSNorm's (Llama,
    Mistral, Qwen2, Qwen3, including Qwen3's per-head q_norm / k_norm) - becomes
    `FusedRMSNorm` (parallel_layers/ops/rms_norm.py) over the same weight Parameter: one pass
    forward, one backward, HF's roundings (docs/kernels.md, the RMSNorm contract).
  - a decoder layer of the Llama form whose post-attention norm became a FusedRMSNorm: its
    attention's residual add and that norm run as one `rms_norm_add` (Note [fused residual
    add]); the layer keeps its class, its children and their names.

Note [fused modules]: a module is recognised by what its forward computes, read from its
source, not by its class name: a family that writes the same expression is fused, one that
changes it (another activation, a gate applied elsewhere, a dropout) is left alone, so the
swap can never change the model's math. It runs after tensor parallelism converted the
linear layers (both projections column-parallel, or both plain) and before the sequence-
parallel hooks, which then land on the fused module under the same name (the final norm's
gather); the gradient sums of the norms' weights under sequence parallelism are hooks on the
weight Parameters, which the fused norms share. A module of a family whose form fuse() knows
(Llama, Mistral, Qwen2, Qwen3) that it leaves alone - a later transformers that rewrote it, a
GeLU-gated MLP, projections split differently by a plan - gets a warning naming its class, so
that a model silently running unfused is visible.

Note [fused residual add]: Hugging Face's Llama decoder layer (Mistral's, Qwen2's and Qwen3's
are the same code, in transformers 5.23 and 5.17 alike) computes

    residual = x;  h = input_layernorm(x);  h = self_attn(h, ...)
    h = residual + h;  residual = h;  h = post_attention_layernorm(h)     # <- fused here
    return residual + mlp(h)

The marked line reads and writes the residual stream twice, forward and backward (there the
stream's gradient from the final add and the norm's input gradient are added by autograd);
`rms_norm_add` computes the sum and its norm in one pass and adds the two gradients inside the
norm's backward pass. Forward, the same bits: the sum is rounded to the stream's dtype before the
norm, as the module's `residual + h` is, and IEEE addition is commutative. Backward, the stream's
gradient is added to the norm's input gradient before that is rounded to the dtype (autograd adds
the rounded one): one rounding instead of two. The layer is recognised by its
forward's tokens (comments and layout ignored; signature, annotations and every statement
included) against a digest of that forward (`_LLAMA_DECODER_FORWARD`): any other form - another
family's, a later transformers that changes one token - keeps its own forward, so the swap can
only run the computation it replaces. The layer gets an instance `forward` (nn.Module's call runs
it between the layer's hooks, as activation checkpointing's does) and keeps its class, its
children's names and its state dict. Under autocast the attention output is 16-bit and the stream
float32; `residual + h` promotes, which the fused op does not, so that call runs the three
statements as written. The last add (layer i's output) and layer i+1's input norm stay apart: they
sit on either side of the model's loop over layers, which is the model's forward, not the layer's.

transformers' own gradient checkpointing (`model.activation_checkpointing_enable()`, formerly
`gradient_checkpointing_enable()`) is a wrapper
that GradientCheckpointingLayer puts around every decoder layer class's forward; the digest is read
through that wrapper (and through no other: a forward wrapped by anything else is not recognised),
and while the layer trains with it enabled the fused forward hands the call to the class's, which
checkpoints the model's own statements. The library's `activation_checkpointing` (which refuses to
run on top of transformers') checkpoints the fused forward. The instance forward is a
functools.partial over the layer, so deepcopy and pickle rebind it to the copy; a shallow copy
(copy.copy, torch.nn.DataParallel's replicas) would still call the original layer's modules.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import os
import sys
import textwrap
import tokenize
import warnings

import torch.nn as nn

from parallel_layers import _peft
from parallel_layers.ops.rms_norm import FusedRMSNorm
from parallel_layers.tensor_parallel.layers import (ColumnParallelLinear, PackedSwiGLUMLP, RowParallelLinear,
                                                   SwiGLUMLP, has_hooks)

# The forward bodies fuse() recognises, statement by statement as `_forward_body` writes them (a
# docstring dropped; the whole body must be one of these: Note [fused modules]).
# LlamaMLP.forward's (and that of every SwiGLU MLP in transformers 5.23 but Seed-OSS's, which
# applies a dropout after down_proj), and Idefics' one-statement form:
_SWIGLU_BODIES = frozenset([
    "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)); return down_proj",
    "return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"])
# Phi3MLP.forward's (GlmMLP's and Glm4MLP's are the same): gate and up packed in one layer
_PACKED_GATED_BODY = ("up_states = self.gate_up_proj(hidden_states); gate, up_states = up_states.chunk(2, dim=-1); "
                      "up_states = up_states * self.activation_fn(gate); return self.down_proj(up_states)")
# LlamaRMSNorm.forward's (Qwen2's, Qwen3's and Mistral's are the same)
_RMS_NORM_BODY = ("input_dtype = hidden_states.dtype; hidden_states = hidden_states.to(torch.float32); "
                  "variance = hidden_states.pow(2).mean(-1, keepdim=True); "
                  "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon); "
                  "return self.weight * hidden_states.to(input_dtype)")


# sha256 of `_forward_tokens` of LlamaDecoderLayer.forward in transformers 5.23 (Note [fused
# residual add]; tests/test_fused.py checks it against the installed transformers)
_LLAMA_DECODER_FORWARD = "0fa2ba0188f9280a5e1a608c163f37acb1da11d9f466178b986bec6b9723f64b"
# transformers' GradientCheckpointingLayer.__init_subclass__ wrapper: (function name, file)
_HF_CHECKPOINT_WRAPPER = ("forward_with_checkpointing", "modeling_layers.py")
# The classes of the families whose forms fuse() knows: one of them left as it is means that the
# installed transformers writes it otherwise, or that its parts are not laid out as the swap needs;
# fuse() says which (Note [fused modules]).
_KNOWN_CLASSES = frozenset([f"{family}{kind}" for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
                            for kind in ("MLP", "RMSNorm", "DecoderLayer")] + ["Phi3MLP", "GlmMLP", "Glm4MLP"])
_LAYOUT_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER}


def _readable_forward(cls: type):
    """`cls.forward` if its source is what runs: the function itself, or one wrapped only by
    transformers' gradient-checkpointing wrapper (GradientCheckpointingLayer wraps every subclass's
    forward; it runs the wrapped one, under checkpoint when enabled). Any other wrapper (a
    decorator with functools.wraps, whose source inspect would read through) may compute something
    else: None."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        code = getattr(forward, "__code__", None)
        where = (getattr(code, "co_name", None), os.path.basename(getattr(code, "co_filename", "")))
        if where != _HF_CHECKPOINT_WRAPPER:
            return None
        forward = forward.__wrapped__
    return forward


def _forward_body(module: nn.Module) -> str:
    """The statements of the forward that `module` runs, each as `ast.unparse` writes it (layout,
    comments and a docstring dropped), joined by "; "; "" where that is not its class's forward
    read from source (an instance forward, a C extension or a REPL class, another wrapper)."""
    if "forward" in vars(module):  # an instance forward: not the class's source
        return ""
    return _class_forward_body(type(module), type(module).forward)


@functools.lru_cache(maxsize=None)
def _class_forward_body(cls: type, forward) -> str:
    """`_forward_body` of the class's `forward`, read once a class and forward (fuse looks at
    every module; a forward patched onto the class is another key)."""
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(_readable_forward(cls)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return ""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return "; ".join(ast.unparse(statement) for statement in body)


def _forward_tokens(cls: type) -> str:
    """The tokens of `cls.forward`'s source, comments and layout dropped ("" if none)."""
    try:
        source = inspect.getsource(_readable_forward(cls))
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return " ".join(t.string for t in tokens if t.type not in _LAYOUT_TOKENS)
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return ""


def _is_llama_decoder_layer(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "post_attention_layernorm", None), FusedRMSNorm)
            and "forward" not in vars(module)  # an instance forward already (ours, or checkpointing's)
            and hashlib.sha256(_forward_tokens(type(module)).encode()).hexdigest() == _LLAMA_DECODER_FORWARD)


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """A Llama-form decoder layer's forward with its middle residual add and post-attention
    norm as one `rms_norm_add` (Note [fused residual add]); given the layer by `fuse`."""
    if self.training and getattr(self, "gradient_checkpointing", False):
        # transformers' gradient checkpointing (activation_checkpointing_enable()) is the class's
        # forward, a wrapper around the model's own: run it, unfused, rather than bypass it
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if hidden_states.dtype == residual.dtype and not has_hooks(self.post_attention_layernorm):
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    else:  # autocast: a 16-bit attention output onto a float32 stream, which the add promotes; or
        # hooks on the norm, which expect its one input and output (Note [hooks on fused parts])
        residual = residual + hidden_states
        hidden_states = self.post_attention_layernorm(residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _is_silu(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _is_llama_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and _forward_body(module) == _RMS_NORM_BODY)


def _swiglu_parts(module: nn.Module):
    """(gate_proj, up_proj, down_proj) if `module` is a SwiGLU MLP that SwiGLUMLP computes alike."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    gate, up, down = parts
    if not _is_silu(getattr(module, "act_fn", None)) or _forward_body(module) not in _SWIGLU_BODIES:
        return None
    if (type(gate), type(up)) == (ColumnParallelLinear, ColumnParallelLinear):
        if not isinstance(down, RowParallelLinear) or gate.gather_output or gate.activation or gate.fused_sizes:
            return None
    elif (type(gate), type(up)) != (nn.Linear, nn.Linear) or not isinstance(down, nn.Linear):
        return None
    return parts


def is_packed_gated_mlp(module: nn.Module) -> bool:
    """Does `module`'s forward compute `down_proj(up * act(gate))` from `gate, up =
    gate_up_proj(x).chunk(2, -1)` (Phi-3, GLM, GLM-4), whatever its activation? Then splitting
    gate_up_proj's two halves block by block over tp leaves each rank's chunk its own gate and
    up features (tensor_parallel/plan.py, Note [packed MLPs split block by block])."""
    return _forward_body(module) == _PACKED_GATED_BODY and all(
        isinstance(getattr(module, name, None), nn.Module) for name in ("gate_up_proj", "down_proj"))


def _packed_swiglu_parts(module: nn.Module):
    """(gate_up_proj, down_proj) if `module` is a packed SwiGLU MLP that PackedSwiGLUMLP computes
    alike: a SiLU activation, and both layers plain or split block by block before a row layer."""
    if not is_packed_gated_mlp(module) or not _is_silu(getattr(module, "activation_fn", None)):
        return None
    gate_up, down = module.gate_up_proj, module.down_proj
    if type(gate_up) is ColumnParallelLinear:
        half = gate_up.out_features // 2
        if not isinstance(down, RowParallelLinear) or gate_up.gather_output or gate_up.activation or \
                gate_up.fused_sizes != (half, half):
            return None
    elif type(gate_up) is not nn.Linear or type(down) is not nn.Linear or gate_up.out_features % 2:
        return None
    return gate_up, down


def fuse(model: nn.Module) -> list[str]:
    """Swap every recognised module of `model` for its fused counterpart, in place (Note [fused
    modules]), and give the recognised decoder layers the fused residual add (Note [fused
    residual add]); returns the names of the modules swapped and of the layers changed."""
    swapped, hooked = [], []
    for name, module in list(model.named_modules()):
        if not name:
            continue
        if _is_llama_rms_norm(module) or _packed_swiglu_parts(module) is not None or _swiglu_parts(module) is not None:
            if has_hooks(module):  # its replacement would not carry them (Note [hooks on fused parts])
                hooked.append(name)
                continue
        if _is_llama_rms_norm(module):
            fused = FusedRMSNorm.from_hf(module)
        elif (packed := _packed_swiglu_parts(module)) is not None:
            fused = PackedSwiGLUMLP(*packed)
        else:
            parts = _swiglu_parts(module)
            if parts is None:
                continue
            fused = SwiGLUMLP(*parts)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, fused)
        swapped.append(name)
    for name, module in model.named_modules():  # after the norms: a layer's norm is fused first
        if _is_llama_decoder_layer(module):
            # a partial, not a bound method: pickle (torch.save of the model) looks a bound method up
            # by its function's name on the module, which has none of that name
            module.forward = functools.partial(_decoder_layer_forward, module)
            swapped.append(name)
    if hooked:
        warnings.warn(f"fuse: {len(hooked)} module(s) that it would swap have hooks, which the fused module would "
                      f"not carry, and keep their own forward, unfused: {hooked[:4]}. Register hooks after "
                      "parallelize (hooks on a fused MLP's gate_proj / up_proj run, unfused: Note [hooks on fused "
                      "parts] in parallel_layers/tensor_parallel/layers.py), or pass fused_kernels=False",
                      stacklevel=3)
    _warn_left_alone(model, swapped + hooked)
    return swapped


def _warn_left_alone(model: nn.Module, swapped: list[str]) -> None:
    """A warning naming the modules of the known families that `fuse` did not change."""
    changed = set(swapped)
    left: dict[str, int] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        fused_before = getattr(vars(module).get("forward"), "func", None) is _decoder_layer_forward  # a 2nd fuse()
        # an MLP whose projections peft adapted runs them as peft's layers (adapters added): unfused by design
        adapted = any(_peft.is_lora_layer(child) for child in module.children())
        if name and name not in changed and cls in _KNOWN_CLASSES and not fused_before and not adapted:
            left[cls] = left.get(cls, 0) + 1
    if left:
        version = getattr(sys.modules.get("transformers"), "__version__", "?")
        listing = ", ".join(f"{count} {cls}" for cls, count in sorted(left.items()))
        warnings.warn(
            f"fuse: {listing} of transformers {version} keep their own forward, unfused. parallel_layers fuses "
            "these families' modules where they compute the form it knows (transformers 5.17-5.23): an MLP "
            "down_proj(act_fn(gate_proj(x)) * up_proj(x)) with a SiLU act_fn and gate_proj, up_proj both plain or "
            "both column-parallel, or down_proj(up * activation_fn(gate)) of gate, up = "
            "gate_up_proj(x).chunk(2, -1) with gate_up_proj plain or split block by block; Llama's RMSNorm; Llama's decoder layer, once its post-attention norm is fused "
            "(Note [fused modules] in parallel_layers/fused.py)", stacklevel=3)


def pack(model: nn.Module) -> None:
    """Give the fused modules' packed tensors one allocation again (after `model.to(device)`,
    which gives every tensor storage of its own)."""
    for module in model.modules():
        if isinstance(module, SwiGLUMLP):
            module.pack_()


__all__ = ["fuse", "pack"]
