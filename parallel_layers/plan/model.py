"""The model the planner plans for: `ModelSpec` (its shape and parameter count), given by hand
or read from a Hugging Face `config.json` without building the model (`hf_config_spec`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

GB = 1e9
MLP_KINDS = ("gelu", "swiglu")


def parse_size(text: str | float | int) -> float:
    """'80GB', '80 GiB', '512MB', '7e9', '7B' (a count), 1e9 -> a number (bytes or a count)."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise ValueError(f"cannot parse size {text!r}: expected a number with an optional unit, one of "
                         f"{sorted(u for u in units if u)} (e.g. '80GB', '7e9', '7B')")
    return float(m.group(1)) * units[m.group(2)]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: total parameters (embedding and head included; None: counted
    from the shape), layers, hidden size, training sequence length, and the shape details.

    `ModelSpec.from_hf_config(path, seq=...)` reads them from a Hugging Face config.json."""

    params: float | None
    layers: int
    hidden: int
    seq: int
    heads: int | None = None  # default hidden / 128
    vocab: int = 32000
    ffn: int | None = None  # MLP width (intermediate_size), default 4 * hidden
    kv_heads: int | None = None  # grouped-query attention's key/value heads, default = heads
    head_dim: int | None = None  # default hidden / heads
    mlp: str = "gelu"  # "gelu": two matrices h x ffn; "swiglu": three (gate, up, down)
    tied: bool = True  # the LM head shares the embedding's weight
    positions: int = 0  # rows of a learned position table (GPT-2's wpe); 0 for rotary/ALiBi models
    dropout: bool = True  # the model's own dropout (GPT-2: 0.1; Llama: 0); TrainSpec may override
    name: str = ""
    mlp_kept: int | None = None  # ffn-wide tensors an MLP keeps for backward a token (default gelu 2, swiglu 3 fused / 4)
    experts: int = 0  # a mixture of experts: MLPs per layer (each of width ffn), 0 for a dense model
    experts_per_token: int = 0  # how many of them each token goes through (the router's top-k)

    def __post_init__(self):
        for name in ("layers", "hidden", "seq", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("heads", "ffn", "kv_heads", "head_dim", "mlp_kept"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be positive or None, got {getattr(self, name)!r}")
        if self.experts or self.experts_per_token:
            if not 0 < self.experts_per_token <= self.experts:
                raise ValueError(f"ModelSpec: experts_per_token {self.experts_per_token} must be in 1..experts "
                                 f"({self.experts}) for a mixture of experts (both 0 for a dense model)")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"ModelSpec.mlp must be one of {list(MLP_KINDS)}, got {self.mlp!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"heads {self.n_heads} must be a multiple of kv_heads {self.n_kv_heads} "
                             "(grouped-query attention shares each key/value head among heads / kv_heads heads)")
        if self.positions and self.seq > self.positions:
            raise ValueError(f"seq {self.seq} > the model's {self.positions} learned positions "
                             f"({self.name or 'the position table'} has {self.positions} rows)")
        if self.params is None:
            object.__setattr__(self, "params", float(self.shape_params()))
        elif self.params <= 0:
            raise ValueError(f"ModelSpec.params must be positive, got {self.params!r}")
        if self.params <= self.embedding_params:
            parts = (f"vocab {self.vocab} * hidden {self.hidden}" + ("" if self.tied else " * 2 (untied head)")
                     + (f" + positions {self.positions} * hidden" if self.positions else ""))
            raise ValueError(f"params {self.params:.3g} <= the embedding alone ({parts} = {self.embedding_params:.3g}); "
                             "check --params and --vocab")

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike | dict, seq: int) -> ModelSpec:
        """The shape of a Hugging Face model from its config.json (a file, a model directory, or
        the parsed dict), read as JSON: no model is built. See `hf_config_spec`."""
        return hf_config_spec(path, seq)

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def q_width(self) -> int:
        """Width of the queries (and the attention output): heads * head_dim."""
        return self.n_heads * self.d_head

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.d_head

    @property
    def embedding_params(self) -> float:
        """Token embedding, the untied head, and a learned position table."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden

    @property
    def layer_params(self) -> float:
        """Parameters of one layer: everything but the embedding (and head), spread over the layers."""
        return (self.params - self.embedding_params) / self.layers

    @property
    def mlp_params(self) -> int:
        """One MLP's matrices (one expert's, in a mixture of experts)."""
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn_width

    def shape_params(self) -> int:
        """The parameter count of this shape without biases: attention (q, k, v, o), the MLP's
        2 or 3 matrices (every expert's, and the router's [experts, hidden]), two norms per layer
        (weight and bias, as `_stage_params` assumes), the final norm, embedding, untied head and
        position table."""
        h = self.hidden
        attention = 2 * h * self.q_width + 2 * h * self.kv_width
        mlp = self.experts * (self.mlp_params + h) if self.experts else self.mlp_params
        return self.layers * (attention + mlp + 4 * h) + 2 * h + int(self.embedding_params)

    @property
    def active_layer_params(self) -> float:
        """The parameters of one layer that multiply a token: a mixture of experts' token goes
        through experts_per_token of its experts only."""
        return self.layer_params - (self.experts - self.experts_per_token) * self.mlp_params

    def matmul_params(self) -> float:
        """Parameters that multiply every token (6 flops each in training): the layers and the
        head; the embedding and position lookups cost none."""
        return self.layers * self.active_layer_params + self.vocab * self.hidden


# ---- Hugging Face configs ---------------------------------------------------------------------
# What each family's config.json means (transformers' modeling code), so that no model is built:
#   llama, mistral, qwen2: hidden_size, num_hidden_layers, num_attention_heads,
#     num_key_value_heads (absent: = heads), head_dim (absent or null: hidden / heads),
#     intermediate_size of a gated SwiGLU MLP (gate, up, down), vocab_size, RMSNorm (weight only)
#     twice per layer and once at the end, no position table (rotary), tie_word_embeddings
#     (absent: False for these families). Biases: llama's attention_bias on q, k, v and o,
#     mlp_bias on gate, up and down; qwen2 always on q, k and v (never o); mistral none. qwen3 is
#     llama's (attention_bias on q, k, v and o; no mlp_bias) plus a head_dim RMSNorm on q and on k
#     in every layer (q_norm, k_norm).
#   mixtral, qwen3_moe: mistral's and qwen3's attention; every layer's MLP a mixture of experts:
#     num_local_experts (qwen3_moe: num_experts) SwiGLU experts of intermediate_size (qwen3_moe:
#     moe_intermediate_size), num_experts_per_tok of them per token, and a router [experts,
#     hidden] without bias. Qwen3-MoE layers listed in mlp_only_layers, or off its
#     decoder_sparse_step, are dense MLPs: a model that mixes them is refused (one layer shape).
#   gpt2: n_embd, n_layer, n_head, n_inner (null: 4 * n_embd) of a GeLU MLP, n_positions rows of
#     learned positions, LayerNorm (weight and bias) twice per layer and at the end, biases on
#     every Conv1D, the head tied to the token embedding.
_GATED = {"llama": "attention_bias", "mistral": None, "qwen2": "qkv", "qwen3": "attention_bias", "mixtral": None,
          "qwen3_moe": "attention_bias"}
# model_type -> its (experts, experts per token, expert width) keys; transformers 5 writes
# Qwen3-MoE's expert count as num_local_experts, the published configs say num_experts
_MOE_KEYS = {"mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
             "qwen3_moe": ("num_local_experts|num_experts", "num_experts_per_tok", "moe_intermediate_size")}
# ffn-wide tensors GPT-2's MLP keeps for backward a token, by activation_function: torch's fused
# gelu keeps its input (and c_proj its output); transformers' "gelu_new" (NewGELUActivation) is
# 0.5 * x * (1 + tanh(...)) in elementwise ops, which keep x, the tanh, 0.5 * x, 1 + tanh and
# the product (measured by --verify: 25% over the peak with 2).
_GPT2_GELU_KEPT = {"gelu_new": 5, "gelu": 2, "gelu_pytorch_tanh": 2}
HF_FAMILIES = tuple(sorted([*_GATED, "gpt2"]))


def _read_hf_config(path: str | os.PathLike | dict) -> dict:
    if isinstance(path, dict):
        return path
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    if not os.path.isfile(file):
        where = (f"the directory {os.fspath(path)!r} has no config.json (it holds {sorted(os.listdir(path))[:8]})"
                 if os.path.isdir(path) else f"{os.fspath(path)!r} does not exist")
        raise FileNotFoundError(f"Hugging Face config: {where}; pass a config.json or a model directory "
                                "written by save_pretrained")
    with open(file) as f:
        return json.load(f)


def _need(cfg: dict, key: str, family: str):
    if cfg.get(key) is None:
        raise ValueError(f"Hugging Face config of model_type {family!r} lacks {key!r} (it has {sorted(cfg)[:12]}...)")
    return cfg[key]


def hf_config_spec(path: str | os.PathLike | dict, seq: int) -> ModelSpec:
    """ModelSpec of a Hugging Face config (file, directory or dict) at training length `seq`,
    its `params` counted exactly from the shape, biases and norms included (equal to
    sum(p.numel()) of the model transformers builds from it; tests/test_plan_hf.py)."""
    cfg = _read_hf_config(path)
    family = cfg.get("model_type")
    dropout = any(float(cfg.get(k) or 0) > 0 for k in ("attention_dropout", "attn_pdrop", "resid_pdrop",
                                                       "embd_pdrop", "hidden_dropout"))
    if family == "gpt2":
        h, layers, heads = (int(_need(cfg, k, family)) for k in ("n_embd", "n_layer", "n_head"))
        vocab, positions = int(_need(cfg, "vocab_size", family)), int(_need(cfg, "n_positions", family))
        ffn = int(cfg.get("n_inner") or 4 * h)
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GPT2_GELU_KEPT:
            raise ValueError(f"Hugging Face config of model_type 'gpt2': activation_function {act!r}; the planner "
                             f"knows {sorted(_GPT2_GELU_KEPT)}")
        per_layer = (2 * h  # ln_1
                     + h * 3 * h + 3 * h  # c_attn (fused q, k, v) with bias
                     + h * h + h  # attention c_proj
                     + 2 * h  # ln_2
                     + h * ffn + ffn + ffn * h + h)  # mlp c_fc, c_proj
        params = layers * per_layer + 2 * h + vocab * h + positions * h  # ln_f, wte (tied head), wpe
        return ModelSpec(params, layers, h, seq, heads, vocab, ffn, heads, h // heads, "gelu", True, positions,
                         dropout, "gpt2", _GPT2_GELU_KEPT[act])
    if family not in _GATED:
        raise ValueError(f"Hugging Face model_type {family!r} is not supported by the planner; supported: "
                         f"{list(HF_FAMILIES)} (or give --params --layers --hidden --heads --ffn by hand)")
    h, layers, heads = (int(_need(cfg, k, family)) for k in ("hidden_size", "num_hidden_layers",
                                                              "num_attention_heads"))
    experts = per_token = 0
    if family in _MOE_KEYS:
        experts, per_token, ffn = (int(_need(cfg, next((k for k in keys.split("|") if cfg.get(k) is not None),
                                                        keys.split("|")[-1]), family))
                                   for keys in _MOE_KEYS[family])
        dense = [i for i in range(int(_need(cfg, "num_hidden_layers", family)))
                 if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % int(cfg.get("decoder_sparse_step") or 1)]
        if dense:
            raise ValueError(f"Hugging Face config of model_type {family!r}: layers {dense[:8]} have dense MLPs "
                             f"(mlp_only_layers {cfg.get('mlp_only_layers')}, decoder_sparse_step "
                             f"{cfg.get('decoder_sparse_step')}); the planner models every layer alike")
    else:
        ffn = int(_need(cfg, "intermediate_size", family))
    vocab = int(_need(cfg, "vocab_size", family))
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Hugging Face config of model_type {family!r}: hidden_act {act!r} in a gated MLP; the "
                         "planner models SwiGLU (hidden_act 'silu')")
    q, k = heads * hd, kv * hd
    attention = h * q + 2 * h * k + q * h
    if _GATED[family] == "attention_bias" and cfg.get("attention_bias"):
        attention += q + 2 * k + h
    elif _GATED[family] == "qkv":
        attention += q + 2 * k
    if family in ("qwen3", "qwen3_moe"):
        attention += 2 * hd  # q_norm, k_norm
    mlp = 3 * h * ffn + (2 * ffn + h if cfg.get("mlp_bias") and family == "llama" else 0)
    if experts:
        mlp = experts * (mlp + h)  # every expert, and the router's row for it
    params = layers * (attention + mlp + 2 * h) + h + vocab * h * (1 if tied else 2)  # 2 RMSNorms, final norm
    return ModelSpec(params, layers, h, seq, heads, vocab, ffn, kv, hd, "swiglu", tied, 0, dropout, family,
                     experts=experts, experts_per_token=per_token)


