"""Layout planner: which (dp, tp, pp, cp, ZeRO stage, recomputation, microbatches) to train a transformer with.

    python -m parallel_layers.plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 \\
        --gpus 64 --gpus-per-node 8 --gpu-mem 80GB
    python -m parallel_layers.plan --hf-config path/to/model_dir --seq 4096 --gpus 64 --gpus-per-node 8 --gpu h100
    python -m parallel_layers.plan --hf-config small_model/ --seq 128 --gpus 2 --gpus-per-node 2 --verify 2

    best, rejected = recommend(ModelSpec(7e9, 32, 4096, 4096), ClusterSpec(64, 8, parse_size("80GB")))
    best, rejected = recommend(ModelSpec.from_hf_config("model_dir", seq=4096), ClusterSpec.preset("h100", 64))

Every layout with dp * tp * pp * cp = gpus (and each ZeRO stage, virtual pipeline stage count,
recomputation and optimizer offload) is estimated (per-rank memory, communication per step,
pipeline bubble, step time), the rules of docs/parallelism.md ("Composing") pick one, and every
other layout carries the reason it lost, with its numbers. docs/planner.md has the whole model,
its sources, and the published layouts it is checked against (tests/test_plan_published.py).
`--verify N` runs the N best layouts that fit this machine and compares the predicted peak
memory and step time with measured ones (parallel_layers/_verify.py).

Memory per rank, the model (bytes per parameter of this rank's share, Ψ = the largest pipeline
stage's params / tp, with norms and row biases replicated over tp, N = dp * cp):
  precision "mixed" (ZeRO paper): 2 param + 2 grad + 12 optimizer (fp32 master, Adam m, v);
  precision "fp32": 4 param + 4 grad + 8 optimizer (Adam m, v; the param is the master).
  ZeRO 0 = DataParallel: all of it, plus one more gradient-sized buffer when dp > 1 (our
           DataParallel packs gradients into bucket buffers of their own, not views of .grad).
  ZeRO 1: optimizer / N. ZeRO 2: also grads / N, plus one layer's full grads (reduced per layer)
           and the root group's (reduced last: a tied embedding, a position table, the final norm).
  ZeRO 3: also params / N, plus two units' full params (the gathered one and the prefetched one;
           a unit is a layer, or the embedding or head when untied) and the root's, whole all step;
           on the CPU also the buffer pool's idle gather buffers, a layer's params each
           (TrainSpec.pooled_gather_buffers, set by --verify).
  Optimizer offload (ZeRO >= 1): the optimizer shard lives in host memory instead.
  The peak (Note [peak memory]): params + optimizer + the larger of (activations + the loss's
  temporaries + the gradients that exist by the loss: DataParallel's buckets, and with m > 1
  the accumulated ones plus the largest layer's being added) and all the gradients.
Activations, per layer and token (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models": s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit with dropout and eager
attention; e bytes per element, a heads, q = heads * head_dim, k = kv_heads * head_dim, f the MLP
width, t = tp, sequence parallel divides the part outside the TP region by t too):
  outside the TP region: 4h elements (both norms' inputs and outputs), 2h bytes of
      dropout masks when dropout is on (2h elements on the CPU, whose dropout keeps its mask in
      the input's dtype: TrainSpec.dropout_mask_bytes, set by --verify), 16 bytes of norm
      statistics (fp32);
  inside it (/ t): q + 2k (Q, K, V) + q (attention output) + the MLP's: GeLU 2f (its input and
      output), SwiGLU 3f (parallelize's fused `linear_swiglu`: the packed [gate; up] and their
      product; 4f unfused - TrainSpec.fused_kernels=False, and a mixture's experts: gate, up,
      silu(gate), the product, as Hugging Face's eager LlamaMLP keeps);
  attention scores (/ t): eager: a * s * (2e + 1) bytes with dropout (probabilities, mask,
      dropped; 3e on the CPU), a * s * e without (the probabilities); flash: 4a bytes (fp32
      log-sum-exp).
  Recomputation: "selective" drops the scores term (recomputed in backward: the 5as/h of the
  formula; nothing changes with flash attention, which recomputes them already); "full" keeps
  only each layer's input, e*h per token (/ t with sequence parallel), plus one layer's full
  activations while it is recomputed.
  The last stage adds the head: final norm input and output (2h elements) and the
  cross-entropy's fp32 softmax over its vocab / t slice (4 * vocab / t bytes; the whole vocab
  when the head's output is gathered, TrainSpec.vocab_parallel_loss=False), and for a moment two
  more such fp32 copies (the logits and the loss's input in forward; two gradients in backward).
  1F1B: stage 0 holds p microbatches of activations, the last stage one; interleaved (v virtual
  stages) stage 0 holds (1 + (p - 1) / (p v)) times that. Context parallel splits each sequence's
  tokens over cp ranks (the scores still span the whole sequence).
Communication per rank per step (ring collectives: all-reduce moves 2(n-1)/n of the buffer,
all-gather and reduce-scatter (n-1)/n): dp gradients (ZeRO 0: one all-reduce; 1: reduce-
scatter + all-gather of params; 2: a reduce-scatter per microbatch + the all-gather; 3: per
microbatch two all-gathers and a reduce-scatter); tp: four activation all-reduces per layer (or
the same bytes as all-gathers and reduce-scatters with sequence parallel; six with full
recomputation) and two for the vocab-parallel embedding and head, per microbatch; cp: K and V
all-gathered in forward and again in backward plus their gradients reduce-scattered, per layer
and microbatch; pp: one activation forward and one gradient backward per microbatch and virtual stage.
Step time = compute / (1 - bubble) + tp, cp and pp communication + the part of dp communication
that compute does not hide (ZeRO-3: all of compute; ZeRO-2: backward, 2/3 of it; stages 0 and 1:
the last microbatch's backward, none after a pipeline's flush) + the offloaded optimizer
step (PCIe both ways and the host's Adam); compute = model flops (6 per matmul parameter per
token + 12 * layers * seq * q for attention, plus the recomputed forward) at `mfu` of the peak.
An axis runs at intra-node bandwidth when its group fits on one node (mesh order pp, dp, cp, tp:
tp innermost), at inter-node bandwidth otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

GB = 1e9
_PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes per parameter: param, grad, optimizer
_REDUCE_BYTES = 4  # ZeRO's reduce-scatter buffers: float32 (its default reduce_dtype)
RECOMPUTE = ("none", "selective", "full")
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


# ---- cluster ----------------------------------------------------------------------------------
# Datasheet numbers (not measurements): dense 16-bit peak, memory, and per-GPU, per-direction
# bandwidths: NVLink (A100 600 GB/s, H100/H200 900 GB/s both directions) and one InfiniBand NIC
# per GPU (DGX A100: HDR 200 Gb/s; DGX H100: NDR 400 Gb/s).
GPU_PRESETS = {
    "a100-40gb": dict(gpu_mem_bytes=40 * GB, flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    "a100-80gb": dict(gpu_mem_bytes=80 * GB, flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    "h100": dict(gpu_mem_bytes=80 * GB, flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9),
    "h200": dict(gpu_mem_bytes=141 * GB, flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    gpu_mem_bytes: float
    flops: float = 989e12  # per GPU, dense bf16 (H100 SXM)
    intra_node_bw: float = 450e9  # bytes/s per GPU (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per GPU (400 Gb/s InfiniBand)
    mfu: float = 0.5  # fraction of `flops` the GEMMs reach: an assumption, not a measurement
    pcie_bw: float = 25e9  # bytes/s per GPU to host memory (PCIe 4 x16), for optimizer offload
    host_mem_bytes: float = 1e12  # per node, for optimizer offload
    cpu_adam_params_per_s: float = 1e9  # per GPU's share of the host's cores: an assumption

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % min(self.gpus, self.gpus_per_node):
            raise ValueError(f"gpus ({self.gpus}) must be a positive multiple of gpus_per_node "
                             f"({self.gpus_per_node}) or fewer than it")
        for name in ("gpu_mem_bytes", "flops", "intra_node_bw", "inter_node_bw", "pcie_bw", "host_mem_bytes",
                     "cpu_adam_params_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClusterSpec.{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"ClusterSpec.mfu must be in (0, 1], got {self.mfu!r}")

    @classmethod
    def preset(cls, gpu: str, gpus: int, gpus_per_node: int = 8, **overrides) -> ClusterSpec:
        """A cluster of one of GPU_PRESETS' GPUs (datasheet peak, memory, NVLink and NIC bandwidths)."""
        if gpu not in GPU_PRESETS:
            raise ValueError(f"unknown GPU {gpu!r}; presets: {sorted(GPU_PRESETS)} (or give --gpu-mem, --tflops, "
                             "--intra-node-bw, --inter-node-bw)")
        return cls(gpus, gpus_per_node, **{**GPU_PRESETS[gpu], **overrides})


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    global_batch: int = 512  # sequences per optimizer step
    precision: str = "mixed"  # "mixed" (bf16 params/grads/activations, fp32 Adam) or "fp32"
    dropout: bool | None = None  # None: the model's own (ModelSpec.dropout)
    flash_attention: bool = False  # False: eager attention keeps the s x s scores (Megatron's formula)
    sequence_parallel: bool = True  # with tp > 1: norms and dropout split over tp too (same traffic as TP's)
    recompute: str | tuple[str, ...] = "auto"  # "none", "selective", "full"; "auto" or a tuple: the least that fits
    optimizer_offload: bool | None = None  # None: only when nothing fits on the GPU; needs ZeRO >= 1
    micro_batch: int | None = None  # sequences per microbatch; None: searched
    virtual_stages: int | None = None  # interleaved pipeline chunks per rank; None: searched (1, 2, 4)
    context_parallel: int | None = 1  # None: searched; > 1 is modelled only (parallel_layers lacks it)
    zero: int | None = None  # None: searched (0-3)
    tensor_parallel: int | None = None  # None: searched; fixed to compare with a system that had one
    pipeline_parallel: int | None = None  # None: searched (e.g. 1 for a system without pipelines)
    vocab_parallel_loss: bool = True  # False: the head's logits are gathered to the whole vocab on every tp rank
    # bytes a dropout keeps per element for backward: 1 on a GPU (its fused dropout keeps a bool
    # mask); the CPU's keeps the scaled mask in the input's dtype (ATen's unfused dropout)
    dropout_mask_bytes: int = 1
    # parallelize's fused_kernels (its default True): a dense SwiGLU MLP as `linear_swiglu` keeps 3
    # ffn-wide tensors a token for backward, the unfused MLP (and a mixture's experts) 4
    fused_kernels: bool = True
    # a stage's layers' gather buffers that ZeRO-3 keeps idle through the step's peak, a layer's
    # params each: 0 on a GPU (the caching allocator's reuse is not allocated memory); on the CPU
    # its buffer pool keeps the two the next gathers take (Note [CPU buffer reuse] in zero/_group.py)
    pooled_gather_buffers: int = 0
    # a mixture of experts' experts over groups of ep dp ranks: True (ep = dp), False, a number ep,
    # or None: searched (without, and every ep dividing both dp and the expert count)
    expert_parallel: bool | int | None = None

    def __post_init__(self):
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {list(_PRECISIONS)}, got {self.precision!r}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")
        modes = self.recompute if isinstance(self.recompute, tuple) else (self.recompute,)
        if not modes or any(mode not in RECOMPUTE for mode in modes) and modes != ("auto",):
            raise ValueError(f"recompute must be one of {[*RECOMPUTE, 'auto']} or a tuple of {list(RECOMPUTE)} "
                             f"(those the training system has), got {self.recompute!r}")
        for name in ("micro_batch", "virtual_stages", "context_parallel", "tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None (searched), got {value!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2, 3 or None (searched), got {self.zero!r}")
        if not (self.expert_parallel is None or isinstance(self.expert_parallel, bool)
                or isinstance(self.expert_parallel, int) and self.expert_parallel >= 1):
            raise ValueError(f"expert_parallel must be True, False, a positive integer (the data-parallel ranks "
                             f"each MoE layer's experts are spread over) or None (searched), got "
                             f"{self.expert_parallel!r}")
        if self.optimizer_offload and self.zero == 0:
            raise ValueError("optimizer_offload=True needs ZeRO >= 1 (ZeRO-Offload moves the optimizer shard), "
                             "got zero=0")
        for name in ("dropout_mask_bytes", "pooled_gather_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.fused_kernels, bool):
            raise ValueError(f"fused_kernels must be True or False (parallelize's), got {self.fused_kernels!r}")

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int  # 0 = DataParallel
    microbatches: int  # per step and data-parallel replica (gradient accumulation when pp = 1)
    cp: int = 1  # context parallel: each sequence's tokens split over cp ranks
    virtual: int = 1  # interleaved pipeline: chunks per rank
    recompute: str = "none"
    offload: bool = False  # optimizer state in host memory
    ep: int = 1  # a mixture of experts' experts spread over groups of ep dp ranks (expert_parallel); 1: none

    def __post_init__(self):
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"Layout.ep is the number of data-parallel ranks the experts are spread over, a divisor "
                             f"of dp={self.dp} (1: no expert parallelism), got {self.ep!r}")

    def __str__(self) -> str:
        z = f"ZeRO-{self.zero}" if self.zero else ("DDP" if self.dp * self.cp > 1 else "-")
        text = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        text += f" cp={self.cp}" if self.cp > 1 else ""
        text += f" ep={self.ep}" if self.ep > 1 else ""
        text += f" v={self.virtual}" if self.virtual > 1 else ""
        text += f" {z}{'+offload' if self.offload else ''} m={self.microbatches}"
        return text + (f" rc={self.recompute}" if self.recompute != "none" else "")


@dataclasses.dataclass
class Estimate:
    layout: Layout
    micro_batch: int  # sequences per microbatch
    params: float  # bytes per rank, worst stage
    grads: float
    optimizer: float
    activations: float
    comm: dict[str, float]  # bytes per rank per step, by axis
    bubble: float  # fraction of step time
    step_time: float  # seconds
    reason: str | None = None  # why it was rejected; None for the recommendation
    flops: float = 0.0  # hardware flops per step, all GPUs (recomputation included)
    host: float = 0.0  # host bytes per GPU (offloaded optimizer)
    modelled_only: str | None = None  # what of this layout parallel_layers cannot run yet
    loss_temporaries: float = 0.0  # the loss's float32 logits copies beyond the one kept for backward
    grads_at_loss: float = 0.0  # gradient bytes alive while the activations are (see `memory`)

    @property
    def memory(self) -> float:
        """Peak bytes per rank (Note [peak memory])."""
        return (self.params + self.optimizer
                + max(self.activations + self.loss_temporaries + self.grads_at_loss, self.grads))

    def tflops_per_gpu(self, gpus: int) -> float:
        """Achieved hardware TFLOP/s per GPU (as Megatron reports it: recomputation counted)."""
        return self.flops / (gpus * self.step_time) / 1e12


# ---- estimates ----------------------------------------------------------------------------
_REPLICATED = 6  # per layer, in units of hidden: two norms (weight, bias) and two row-parallel biases


def stage_layers(model: ModelSpec, pp: int, v: int = 1) -> int:
    """Layers of the largest pipeline stage: PipelineStages splits unevenly when pp * v does
    not divide the layers (balanced: the largest chunk holds ceil(layers / (pp * v)))."""
    return -(-model.layers // (pp * v)) * v


def _decoder_layer_params(model: ModelSpec, tp: int, held_apart: float = 0.0) -> float:
    """One decoder layer's params per tp rank (its norms and row biases replicated), less
    `held_apart` (the experts under expert parallelism)."""
    replicated = _REPLICATED * model.hidden
    return (model.layer_params - replicated) / tp + replicated - held_apart


def _stage_params(model: ModelSpec, tp: int, pp: int, v: int = 1, held_apart: float = 0.0) -> tuple[float, float]:
    """(params on the largest stage per tp rank, params of ZeRO's largest unit per tp rank: a
    layer, or an untied embedding or head; Note [ZeRO-3's units in the plan]), less
    `held_apart` per layer per tp rank (the experts under expert parallelism)."""
    layer = _decoder_layer_params(model, tp, held_apart)
    embedding = model.vocab * model.hidden / tp  # vocab-parallel
    first = embedding + model.positions * model.hidden
    last = 0.0 if model.tied and pp == 1 else embedding  # the head: tied shares the first's unless pp > 1
    ends = first + last if pp == 1 else max(first, last)
    return stage_layers(model, pp, v) * layer + ends, max(layer, 0.0 if model.tied else embedding)


# Note [ZeRO-3's units in the plan]: parallelize's ZeRO-3 gathers a Hugging Face model's units
# one at a time with the next one prefetched: the decoder layers and, untied, the embedding and
# the head each a unit of its own (Note [vocabulary units] in parallelize.py), so two of the
# largest (`layer`, the larger of a layer and the vocabulary matrix) are whole at once. The
# root group - a tied embedding (its weight read by the head too), a learned position table, the
# final norm - stays whole for the whole step on every rank, and so do its gradients until the
# end of backward, where the root is reduce-scattered last.
def _root_params(model: ModelSpec, tp: int) -> float:
    """Parameters per tp rank that ZeRO-3 keeps whole in its root group."""
    return (model.vocab * model.hidden / tp if model.tied else 0.0) + model.positions * model.hidden + model.hidden


def _layer_token_bytes(model: ModelSpec, train: TrainSpec, tp: int, recompute: str) -> float:
    """Bytes one layer keeps for backward per token of this rank (Korthikanti et al. 2022)."""
    e, h, a, s = train.act_bytes, model.hidden, model.n_heads, model.seq
    dropout = model.dropout if train.dropout is None else train.dropout
    outside_tp = tp if train.sequence_parallel else 1
    if recompute == "full":
        return e * h / outside_tp
    m = train.dropout_mask_bytes
    per_token = (e * 4 * h + (2 * h * m if dropout else 0)) / outside_tp + 16
    swiglu = 3 if train.fused_kernels and not model.experts else 4  # experts run unfused (tensor_parallel/experts.py)
    mlp = (model.mlp_kept or (swiglu if model.mlp == "swiglu" else 2)) * model.ffn_width * max(1, model.experts_per_token)
    per_token += e * (2 * model.q_width + 2 * model.kv_width + mlp) / tp
    if train.flash_attention:
        per_token += 4 * a / tp
    elif recompute == "none":
        per_token += a * s * (2 * e + m if dropout else e) / tp
    return per_token


def activation_bytes(model: ModelSpec, train: TrainSpec, tp: int, tokens: float, layers: int,
                     head: bool, recompute: str = "none") -> float:
    """Bytes saved for backward by `layers` layers (and the head) over `tokens` tokens."""
    total = tokens * layers * _layer_token_bytes(model, train, tp, recompute)
    if head:
        e, outside_tp = train.act_bytes, tp if train.sequence_parallel else 1
        total += tokens * (e * 2 * model.hidden / outside_tp + 4 * _loss_vocab(train, model, tp))
    return total


def _loss_vocab(train: TrainSpec, model: ModelSpec, tp: int) -> float:
    """Vocabulary entries per token the loss sees on a rank: its vocab-parallel slice, or all of
    it when the head's output is gathered (transformers' 'colwise_gather_output' lm_head)."""
    return model.vocab / tp if train.vocab_parallel_loss else model.vocab


def loss_temporaries(model: ModelSpec, train: TrainSpec, tp: int, tokens: float) -> float:
    """Float32 [tokens, vocab] copies the loss holds for a moment beyond the log-softmax kept
    for backward: in forward the logits and the cross-entropy's flattened input beside the
    log-softmax; in backward the gradient of the log-softmax and of its input beside it."""
    return 2 * 4 * tokens * _loss_vocab(train, model, tp)


def _token_flops(model: ModelSpec, train: TrainSpec, recompute: str) -> tuple[float, float]:
    """(flops of one layer, of the head) per token in training: 6 per matmul parameter (forward
    2, backward 4), attention's QK^T and AV (12 * seq * q), and the recomputed forward."""
    attention_forward = 4 * model.seq * model.q_width
    layer = 6 * model.active_layer_params + 3 * attention_forward
    if recompute == "full":  # one more forward of the layer (not of the head)
        layer += 2 * model.active_layer_params + attention_forward
    elif recompute == "selective" and not train.flash_attention:  # QK^T, softmax, AV again
        layer += attention_forward
    return layer, 6 * model.vocab * model.hidden


def _pace(model: ModelSpec, train: TrainSpec, recompute: str, pp: int, v: int) -> float:
    """Flops per token of the busiest pipeline rank. The cut is balanced with the head counted
    (BLOOM's 70 layers + embedding + head filled 12 stages of 6): the last rank's last chunk
    takes k layers and the head, the other pp * v - 1 chunks share the remaining layers evenly
    (ceil); k is the best such split."""
    layer, head = _token_flops(model, train, recompute)
    if pp == 1:
        return model.layers * layer + head
    chunks, best = pp * v, float("inf")
    for k in range(0, -(-model.layers // chunks) + 1):
        rest = -(-(model.layers - k) // (chunks - 1))  # layers of every other chunk
        best = min(best, max(v * rest * layer, (k + (v - 1) * rest) * layer + head))
    return best


def step_flops(model: ModelSpec, train: TrainSpec, recompute: str) -> float:
    """Hardware flops of one step, all GPUs (recomputation included, as Megatron counts them)."""
    layer, head = _token_flops(model, train, recompute)
    return (model.layers * layer + head) * train.global_batch * model.seq


def estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout) -> Estimate:
    """Per-rank memory, communication, bubble and step time of one layout (no rule checks)."""
    dp, tp, pp, zero, m = layout.dp, layout.tp, layout.pp, layout.zero, layout.microbatches
    cp, v, rc = layout.cp, layout.virtual, layout.recompute
    shards = dp * cp  # ZeRO and the gradient reduction span dp x cp (the params are replicated over cp)
    pb, gb, ob = _PRECISIONS[train.precision]
    # Note [experts over dp in the plan]: with layout.ep > 1 each rank holds 1 / ep of the stage's
    # experts (and each of those split over tp), whole: never gathered by ZeRO-3. Over their dp /
    # ep replicas (`replicas`) they are averaged as the rest is over dp, at the end of backward
    # (Note [expert groups] in zero/_hooks.py: their full gradients are all there then, at every
    # stage), and ZeRO shards their optimizer state over them (stage >= 1); with ep = dp they have
    # no replica: params, gradients and optimizer state whole, nothing reduced. Their gradients
    # accumulate whole over microbatches. The rest (`psi`, `layer`) is as without. Per MoE layer
    # and microbatch, two all-to-alls of each token's k hidden vectors in forward and two in
    # backward (and two more in a full recompute), over the ep group.
    ep = layout.ep
    replicas = dp // ep
    expert_layer = model.experts * model.mlp_params / tp if ep > 1 else 0.0
    experts = stage_layers(model, pp, v) * expert_layer / ep
    psi, layer = _stage_params(model, tp, pp, v, held_apart=expert_layer)
    params, grads, opt = psi * pb, psi * gb, psi * ob
    if zero == 0 and shards > 1:
        grads += psi * gb  # DataParallel's bucket buffers
    if zero >= 1:
        opt /= shards
    if zero >= 2 and m == 1:  # the shards, the layer whose gradients are being made, and the one
        # before it being reduce-scattered meanwhile (Note [overlapped reduce-scatter]: float32)
        grads = psi * gb / shards + layer * gb + (layer * _REDUCE_BYTES if shards > 1 else 0.0)
        grads += _root_params(model, tp) * gb * (1 - 1 / shards)  # the root's, whole until it is reduced, last
    elif zero >= 2:  # with microbatches (a PipelineParallel step, under no_sync()): the full
        # gradients accumulate as at stage 1 and are reduce-scattered once, after the last one
        grads = psi * gb + (layer * _REDUCE_BYTES if shards > 1 else 0.0)
    if zero == 3:  # the shards, two units gathered (Note [ZeRO-3's units in the plan]) and the root whole
        kept = _root_params(model, tp)
        params = (psi - kept) * pb / shards + kept * pb + 2 * layer * pb
        if stage_layers(model, pp, v) >= 3:  # the pool serves the blocks that three or more groups repeat
            params += train.pooled_gather_buffers * _decoder_layer_params(model, tp, expert_layer) * pb
    expert_grads = experts * gb * (2 if zero == 0 and replicas > 1 else 1)  # DataParallel: and their buckets
    if zero >= 2 and replicas > 1:  # reduced at the end of backward, a layer's float32 buffer in flight
        expert_grads += expert_layer / ep * _REDUCE_BYTES
    params, grads = params + experts * pb, grads + expert_grads
    opt += experts * ob / (replicas if zero >= 1 else 1)
    host = 0.0
    if layout.offload:
        host, opt = opt, 0.0
    micro_batch = max(1, train.global_batch // (dp * m))
    tokens = micro_batch * model.seq / cp  # this rank's tokens of one microbatch
    n_layers = stage_layers(model, pp, v)
    in_flight = pp * (1 + (pp - 1) / (pp * v) if v > 1 else 1)  # stage 0's microbatches (Korthikanti 4.2.3)
    first = activation_bytes(model, train, tp, tokens * in_flight, n_layers, head=pp == 1, recompute=rc)
    last = activation_bytes(model, train, tp, tokens, n_layers, head=True, recompute=rc)
    acts = max(first, last)
    if rc == "full":  # the layer being recomputed holds its activations until its backward is done
        acts += tokens * _layer_token_bytes(model, train, tp, "none")
    # Note [peak memory]: the states of the ZeRO paper (params, grads, optimizer) never all peak
    # with the activations. Gradients are made in backward as the activations are freed, so a
    # rank peaks either at the loss (all activations kept, the loss's logits copies, and what
    # gradients exist by then: DataParallel's buckets, and with m > 1 those accumulated from the
    # earlier microbatches) or at the end of backward (every gradient); params and optimizer
    # state are there throughout (from the second step on).
    # Only the last stage computes the loss: its copies count where they raise the larger stage.
    temporaries = max(first, last + loss_temporaries(model, train, tp, tokens)) - max(first, last)
    # With m > 1 a microbatch's gradient of a parameter is made in a buffer of its own and then
    # added to the accumulated one: the largest layer's (often the head's) is in flight too.
    accumulated = psi * gb + layer * gb + experts * gb if m > 1 else 0.0
    at_loss = (psi * gb if zero == 0 and shards > 1 else 0.0) + accumulated

    ring = lambda n: (n - 1) / n  # noqa: E731  (fraction of a buffer each rank sends in a ring pass)
    # Every stage reduces the gradients once a step: with microbatches PipelineParallel runs
    # them all under no_sync() and reduces after the last (stages 2 and 3 included); stages 1-2
    # gather the updated params after the step, stage 3 for every microbatch's forward and
    # backward instead.
    if zero == 0:
        dp_bytes = 2 * ring(shards) * psi * gb
    elif zero in (1, 2):
        dp_bytes = ring(shards) * psi * (gb + pb)
    else:
        dp_bytes = ring(shards) * psi * (gb + 2 * pb * m)
    # the experts over their replicas, once a step: all-reduced (DDP) or reduce-scattered and
    # gathered after the step (ZeRO, at every stage as its stage 1)
    dp_bytes += ring(replicas) * experts * (2 * gb if zero == 0 else gb + pb)
    act = tokens * model.hidden * train.act_bytes  # one [s, b, h] activation of this rank
    per_layer = 6 if rc == "full" else 4  # full recomputation repeats the forward's two all-reduces
    tp_bytes = 2 * ring(tp) * act * (per_layer * n_layers + 2) * m
    kv = tokens * cp * model.kv_width / tp * train.act_bytes  # the whole sequence's K and V, this tp shard
    cp_bytes = 3 * ring(cp) * kv * n_layers * m * (2 if rc == "full" else 1) if cp > 1 else 0.0
    pp_bytes = 2 * act * m * v if pp > 1 else 0.0
    ep_bytes = ((6 if rc == "full" else 4) * ring(ep) * act * model.experts_per_token * n_layers * m
                if ep > 1 else 0.0)  # each all-to-all sends (ep - 1) / ep of k rows a token
    comm = {"dp": dp_bytes, "tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "ep": ep_bytes}

    def bandwidth(span: int) -> float:
        return cluster.intra_node_bw if span <= cluster.gpus_per_node else cluster.inter_node_bw
    flops = step_flops(model, train, rc)
    # A pipeline runs at its slowest stage's pace (with pp = 1: the whole model).
    tokens_per_replica = train.global_batch * model.seq / dp
    compute = (_pace(model, train, rc, pp, v) * tokens_per_replica / (tp * cp * cluster.flops * cluster.mfu))
    idle = (pp - 1) / v  # microbatch slots the pipeline idles (interleaving divides them by v)
    bubble = idle / (m + idle)
    # What the dp traffic can hide under: ZeRO-3 gathers in forward and backward (all of it);
    # ZeRO-2 reduce-scatters during backward (2/3 of compute); stages 0 and 1 reduce once, in the
    # last microbatch's backward (pp = 1), or after the pipeline's flush (pp > 1: PipelineParallel
    # reduces once after the last microbatch, as Megatron-LM did). (An approximation: with
    # microbatches PipelineParallel reduces every stage after the last one, and ZeRO-1 at the
    # step, so less hides than this says; the step time is the estimate's least exact part.)
    overlap = {3: 1.0, 2: 2 / 3}.get(zero, 2 / 3 / m if pp == 1 else 0.0)
    offload_time = 0.0
    if layout.offload:  # gradient shard down, updated param shard up, Adam on the host
        offload_time = psi / shards * (gb + pb) / cluster.pcie_bw + psi / shards / cluster.cpu_adam_params_per_s
    step = (compute / (1 - bubble) + tp_bytes / bandwidth(tp) + cp_bytes / bandwidth(tp * cp)
            + pp_bytes / bandwidth(cluster.gpus) + max(0.0, dp_bytes / bandwidth(tp * cp * dp) - overlap * compute)
            + ep_bytes / bandwidth(tp * ep) + offload_time)
    e = Estimate(layout, micro_batch, params, grads, opt, acts, comm, bubble, step, flops=flops, host=host,
                 loss_temporaries=temporaries, grads_at_loss=at_loss)
    if cp > 1:
        e.modelled_only = "context parallel is modelled only: parallel_layers does not implement it yet"
    return e


# ---- candidates and rules -----------------------------------------------------------------
def _structural_reason(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, dp: int, tp: int, pp: int,
                       zero: int, cp: int = 1, v: int = 1) -> str | None:
    """The hard rules (docs/parallelism.md, "Composing"); None when the layout may run."""
    if tp > cluster.gpus_per_node:
        return f"tp={tp} > gpus_per_node {cluster.gpus_per_node}: TP only within a node"
    if model.n_heads % tp:
        return f"heads {model.n_heads} not divisible by tp={tp}"
    if model.n_kv_heads % tp:
        return f"kv heads {model.n_kv_heads} not divisible by tp={tp} (each rank needs whole key/value heads)"
    if model.ffn_width % tp:
        return f"ffn {model.ffn_width} not divisible by tp={tp}"
    if model.layers < pp * v:  # PipelineStages cuts unevenly (balanced), but every stage needs a layer
        return f"layers {model.layers} < pp={pp} x v={v} stages: every pipeline stage needs at least one layer"
    if model.seq % (2 * cp) and cp > 1:
        return f"seq {model.seq} not divisible by 2 * cp={cp} (causal load balance gives each rank two chunks)"
    if train.global_batch % dp:
        return f"global batch {train.global_batch} not divisible by dp={dp}"
    if pp > 1 and zero > 1:
        return f"ZeRO-{zero} with pp={pp}: with PP keep ZeRO at stage 1 (stages 2/3 add a collective per microbatch)"
    if train.global_batch // dp < pp:
        return (f"only {train.global_batch // dp} sequences per replica (global batch {train.global_batch} / dp={dp}) "
                f"< pp={pp}: needs microbatches >= stages")
    if train.micro_batch and (train.global_batch // dp) % train.micro_batch:
        return (f"global batch {train.global_batch} / dp={dp} = {train.global_batch // dp} sequences per replica, "
                f"not a multiple of micro_batch {train.micro_batch}")
    return None


def _microbatch_choices(per_replica: int, pp: int, micro_batch: int | None = None) -> list[int]:
    """Microbatch counts to try: for pp > 1 those >= 4p (fewest first), then fewer down to p;
    for pp = 1 the fewest (no accumulation) first. `_best_of_layout` takes the fastest that fits
    among the first group, ties to fewer (larger microbatches: GEMM efficiency, not modelled)."""
    if micro_batch:
        return [per_replica // micro_batch] if per_replica // micro_batch >= pp else []
    divs = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and m >= pp]
    return [m for m in divs if m >= 4 * pp] + [m for m in reversed(divs) if m < 4 * pp] if pp > 1 else divs


def _memory_options(train: TrainSpec, zero: int) -> list[tuple[str, bool]]:
    """(recompute, offload) pairs in the order they cost time: none; selective (with eager
    attention, a few percent more compute); full (a third more); then the same with the
    optimizer in host memory (a PCIe round trip and a host Adam per step)."""
    rcs = (list(RECOMPUTE) if train.recompute == "auto" else
           sorted(train.recompute, key=RECOMPUTE.index) if isinstance(train.recompute, tuple) else [train.recompute])
    if train.flash_attention and "selective" in rcs and len(rcs) > 1:
        rcs.remove("selective")  # flash attention already recomputes the scores: selective == none
    offloads = [train.optimizer_offload] if train.optimizer_offload is not None else [False, True]
    return [(rc, off) for off in offloads if not (off and zero == 0) for rc in rcs]


def _memory_reason(e: Estimate, cluster: ClusterSpec) -> str:
    return (f"needs {e.memory / GB:.1f} GB per GPU > {cluster.gpu_mem_bytes / GB:.0f} GB (params "
            f"{e.params / GB:.1f} + optimizer {e.optimizer / GB:.1f} + the larger of activations {e.activations / GB:.1f} "
            f"+ loss temporaries {e.loss_temporaries / GB:.1f} + grads meanwhile {e.grads_at_loss / GB:.1f} and grads "
            f"{e.grads / GB:.1f}, at microbatch {e.micro_batch}, recompute {e.layout.recompute}"
            f"{', optimizer offloaded' if e.layout.offload else ''})")


def _fits(e: Estimate, cluster: ClusterSpec) -> bool:
    return (e.memory <= cluster.gpu_mem_bytes
            and e.host * min(cluster.gpus, cluster.gpus_per_node) <= cluster.host_mem_bytes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> list[Estimate]:
    """Every dp * tp * pp * cp = gpus layout with each ZeRO stage (ZeRO only with dp * cp > 1)
    and virtual stage count, estimated at its best microbatch count, recomputation and offload;
    those that break a rule or do not fit carry a reason."""
    if train.expert_parallel and not model.experts:
        raise ValueError(f"expert parallelism spreads a mixture of experts' experts over dp; {model.name or 'this model'} "
                         "is dense (no experts): leave expert_parallel unset (--expert-parallel auto)")
    out = []
    n = cluster.gpus
    cps = [train.context_parallel] if train.context_parallel else [c for c in _divisors(n) if c == 1 or c % 2 == 0]
    fixed = {"context_parallel": train.context_parallel, "tensor_parallel": train.tensor_parallel,
             "pipeline_parallel": train.pipeline_parallel}
    product = 1
    for value in fixed.values():
        product *= value or 1
    if n % product:
        raise ValueError(f"the fixed degrees {', '.join(f'{k}={v}' for k, v in fixed.items() if v)} multiply to "
                         f"{product}, which does not divide gpus {n}")
    for cp in cps:
        for tp in _divisors(n // cp) if not train.tensor_parallel else [train.tensor_parallel]:
            for pp in _divisors(n // (cp * tp)) if not train.pipeline_parallel else [train.pipeline_parallel]:
                if n % (cp * tp * pp):
                    continue  # a fixed degree that this cp x tp leaves no room for
                dp = n // (tp * pp * cp)
                vs = [train.virtual_stages] if train.virtual_stages else [1, 2, 4]
                for v in (vs if pp > 1 else [1]):
                    zeros = [train.zero] if train.zero is not None else list(range(4))
                    if train.optimizer_offload and dp * cp > 1:
                        zeros = [z for z in zeros if z >= 1]  # offload is a ZeRO feature
                    eps = _expert_parallel_choices(model, train, dp, cp)
                    for zero in zeros if dp * cp > 1 else (0,):
                        for ep in eps:
                            out.append(_best_of_layout(model, cluster, train, dp, tp, pp, zero, cp, v, ep))
    return out


def _expert_parallel_choices(model: ModelSpec, train: TrainSpec, dp: int, cp: int) -> list[int]:
    """The ep degrees to estimate at dp: a mixture of experts also with its experts over every
    ep > 1 dividing dp and the expert count (cp = 1); with expert_parallel set, only with (ep =
    dp for True; a degree that does not divide them gets a reason) or only without, where it
    applies."""
    asked = train.expert_parallel
    if not model.experts or dp == 1 or cp > 1 or asked is False:
        return [1]
    if asked is True:
        return [dp]
    if asked is not None:
        return [asked]
    return [1] + [ep for ep in _divisors(dp) if ep > 1 and model.experts % ep == 0]


def _best_of_layout(model, cluster, train, dp, tp, pp, zero, cp, v, ep=1) -> Estimate:
    reason = _structural_reason(model, cluster, train, dp, tp, pp, zero, cp, v)
    if reason is None and dp % ep:
        reason = f"dp={dp} not divisible by ep={ep} (expert parallelism spreads the experts over groups of ep dp ranks)"
    elif reason is None and model.experts % ep:
        over = f"dp={dp} (expert parallelism spreads them over dp)" if ep == dp else f"ep={ep}"
        reason = f"experts {model.experts} not divisible by {over}"
    if reason is not None:
        shown = ep if dp % ep == 0 else 1
        e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, max(1, pp), cp, v, ep=shown))
        e.reason = reason
        return e
    ms = _microbatch_choices(train.global_batch // dp, pp, train.micro_batch)
    options = _memory_options(train, zero)
    if not ms or not options:
        e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, max(1, pp), cp, v, ep=ep))
        e.reason = (f"only {train.global_batch // (dp * train.micro_batch)} microbatches of {train.micro_batch} "
                    f"sequences per replica < pp={pp}: needs microbatches >= stages" if not ms else
                    f"optimizer offload needs ZeRO >= 1 (it moves the optimizer shard), and dp={dp} x cp={cp} runs "
                    "without ZeRO")
        return e
    smallest = None
    wide = [m for m in ms if pp == 1 or m >= 4 * pp]
    for rc, off in options:  # the cheapest option that fits; at it, the fastest microbatch count
        for group in (wide, [m for m in ms if m not in wide]):  # m >= 4p before m < 4p
            fit = []
            for m in group:
                e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, m, cp, v, rc, off, ep))
                if _fits(e, cluster):
                    fit.append(e)
                elif smallest is None or e.memory < smallest.memory:
                    smallest = e
            if fit:  # ties (pp = 1: accumulation costs nothing here) go to fewer, larger microbatches
                return min(fit, key=lambda e: (round(e.step_time, 3), e.layout.microbatches))
    smallest.reason = _memory_reason(smallest, cluster)
    if smallest.host * min(cluster.gpus, cluster.gpus_per_node) > cluster.host_mem_bytes:
        smallest.reason += f"; host memory {smallest.host / GB:.0f} GB per GPU exceeds the node's"
    return smallest


# Pure data parallelism (no TP, PP or CP) wins when it fits without recomputation or offload and
# its step is within this fraction of the fastest layout: it is the simplest to run (no plan, no
# stage cut) and the estimates are not finer than this.
DP_ONLY_SLACK = 0.10
# Estimates closer than this are ties at the model's resolution. A tie goes to ZeRO 0-1 over
# 2-3 (their per-microbatch collectives cost latency the bandwidth model does not see), then,
# among layouts using over half the GPU's memory, to the most headroom (the model leaves out
# allocator fragmentation and temporary buffers, so headroom is what keeps an estimate safe),
# then to less traffic and the simpler layout.
TIE = 0.05


def _tightness(e: Estimate, cluster: ClusterSpec) -> int:
    """GB used beyond half the GPU (0 below it): the tie-break's measure of too little headroom."""
    return round(e.memory / GB) if e.memory > cluster.gpu_mem_bytes / 2 else 0


def recommend(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec = TrainSpec()
              ) -> tuple[Estimate | None, list[Estimate]]:
    """(the recommended layout or None when nothing fits, every other layout with its reason).

    Rules (docs/parallelism.md), after the hard ones in `candidates`: when a layout without
    TP, PP or CP fits without recomputation or offload (and is within DP_ONLY_SLACK of the
    fastest), the model is trained with DDP or ZeRO alone; otherwise TP and PP split it, and
    ZeRO-2/3 are not run across nodes (PP takes the slow links) unless nothing else fits.
    Among those, the fastest estimated step wins, a tie (within TIE) going to the most memory
    headroom; with PP, m >= 4p microbatches are preferred.
    """
    all_ = candidates(model, cluster, train)
    ok = [e for e in all_ if e.reason is None]
    fastest = min((e.step_time for e in ok), default=0.0)
    pure_dp = [e for e in ok if e.layout.tp == e.layout.pp == e.layout.cp == 1 and e.layout.recompute == "none"
               and not e.layout.offload and e.step_time <= (1 + DP_ONLY_SLACK) * fastest]
    if pure_dp:
        dp_best = min(pure_dp, key=lambda e: e.step_time)
        for e in ok:
            if e.layout.tp > 1 or e.layout.pp > 1 or e.layout.cp > 1:
                e.reason = (f"the model fits without TP/PP ({dp_best.layout} needs {dp_best.memory / GB:.1f} GB "
                            "per GPU): DDP/ZeRO only, TP and PP would add communication and bubble")
        ok = [e for e in ok if e.reason is None]
    else:
        # Model parallelism is needed. Across nodes, ZeRO-2/3's per-microbatch traffic would
        # ride the slow links; there PP carries the split and ZeRO stays at stage 1 (section 5).
        low = [e for e in ok if e.layout.zero <= 1]
        for e in ok:
            lay = e.layout
            if low and lay.zero >= 2 and lay.tp * lay.cp * lay.dp > cluster.gpus_per_node:
                e.reason = (f"ZeRO-{lay.zero} over dp={lay.dp} spanning nodes moves {e.comm['dp'] / GB:.0f} GB per "
                            f"step over {cluster.inter_node_bw / GB:.0f} GB/s links (per microbatch); the model needs "
                            "model parallelism, so PP takes the slow links with ZeRO-1")
        ok = [e for e in ok if e.reason is None]
    wide = [e for e in ok if e.layout.pp == 1 or e.layout.microbatches >= 4 * e.layout.pp]
    if wide:  # m < 4p only when no layout reaches it
        for e in ok:
            if e.layout.pp > 1 and e.layout.microbatches < 4 * e.layout.pp:
                e.reason = (f"m={e.layout.microbatches} < 4 * pp={e.layout.pp} (bubble {100 * e.bubble:.0f}%) "
                            "while other layouts reach m >= 4p")
        ok = wide
    # Ties on time (DP traffic hidden under backward) go to less traffic, then the simpler
    # layout: the lower ZeRO stage, no interleaving, no recomputation, no offload.
    key = lambda e: (round(e.step_time, 3), round(sum(e.comm.values()) / GB, 3), e.layout.zero,  # noqa: E731
                     e.layout.virtual, RECOMPUTE.index(e.layout.recompute), e.layout.offload)
    best = min(ok, key=key) if ok else None
    if best is not None and not pure_dp:  # ties between model-parallel layouts (see TIE)
        near = [e for e in ok if e.step_time <= (1 + TIE) * best.step_time]
        best = min(near, key=lambda e: (e.layout.zero >= 2, _tightness(e, cluster), key(e)))
    for e in ok:
        if e is best:
            continue
        if e.step_time > (1 + TIE) * best.step_time:
            e.reason = (f"slower: est. step {e.step_time:.2f} s vs {best.step_time:.2f} s for {best.layout} "
                        f"(bubble {100 * e.bubble:.0f}%, comm {sum(e.comm.values()) / GB:.1f} GB/step)")
        elif e.layout.zero >= 2 > best.layout.zero:
            e.reason = (f"same est. step (within {TIE:.0%}): {e.step_time:.2f} s vs {best.step_time:.2f} s for "
                        f"{best.layout}, with ZeRO-{e.layout.zero} vs {best.layout.zero}: the lower stage wins")
        elif _tightness(e, cluster) > _tightness(best, cluster):
            e.reason = (f"same est. step (within {TIE:.0%}): {e.step_time:.2f} s vs {best.step_time:.2f} s for "
                        f"{best.layout}, which leaves more memory headroom ({best.memory / GB:.0f} vs "
                        f"{e.memory / GB:.0f} GB per GPU; the model omits fragmentation and temporary buffers)")
        else:
            e.reason = (f"same est. step {e.step_time:.2f} s as {best.layout}, with {sum(e.comm.values()) / GB:.1f} "
                        f"vs {sum(best.comm.values()) / GB:.1f} GB/step of communication and ZeRO-{e.layout.zero} vs "
                        f"{best.layout.zero}: the lower stage, less traffic and the simpler layout win")
    for e in all_:
        if e is not best and e.reason is None:  # unreachable guard: every loser must say why
            raise AssertionError(f"{e.layout} was neither recommended nor given a reason")
    rejected = sorted((e for e in all_ if e is not best), key=lambda e: (_rank_of(e.reason), e.step_time))
    return best, rejected


def launch_args(e: Estimate, train: TrainSpec) -> dict:
    """How to run a layout with this library: `init_parallel`'s and `parallelize`'s keyword
    arguments (what a `--verify` run of the top candidates passes), and under "unsupported" what
    of the layout parallel_layers cannot run yet (then the layout cannot be verified here)."""
    lay = e.layout
    unsupported = [f"context parallel cp={lay.cp}"] if lay.cp > 1 else []
    unsupported += ["optimizer offload through parallelize"] if lay.offload else []
    if train.sequence_parallel and lay.tp > 1 and (lay.pp > 1 or lay.microbatches > 1):
        unsupported.append(f"sequence parallel with a pipeline (pp={lay.pp}, microbatches={lay.microbatches})")
    return {
        "init_parallel": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
        "parallelize": {"zero_stage": lay.zero, "microbatches": lay.microbatches,
                        "schedule": "interleaved" if lay.virtual > 1 else "1f1b",
                        "virtual": lay.virtual if lay.virtual > 1 else None,
                        "activation_checkpointing": None if lay.recompute == "none" else lay.recompute,
                        "sequence_parallel": bool(train.sequence_parallel and lay.tp > 1),
                        "expert_parallel": False if lay.ep == 1 else True if lay.ep == lay.dp else lay.ep,
                        "fused_kernels": train.fused_kernels},
        "micro_batch": e.micro_batch,
        "unsupported": unsupported,
    }


# (leading words of a reason, the rule it names): the order of the rejected list, closest first.
_KINDS = (("same est. step", "tie"), ("slower", "slower"), ("m=", "m < 4p"), ("the model fits", "fits without TP/PP"),
          ("needs", "out of memory"), ("tp=", "TP across nodes"), ("heads", "heads % tp"),
          ("kv heads", "kv heads % tp"), ("ffn", "ffn % tp"), ("layers", "layers < stages"), ("seq", "seq % 2cp"),
          ("global batch", "batch % dp"), ("ZeRO-", "ZeRO > 1 with PP or across nodes"),
          ("only", "microbatches < stages"), ("optimizer offload", "offload without ZeRO"),
          ("experts", "experts % dp"))


def reason_kind(reason: str) -> str:
    """The rule a reason comes from, for grouping the rejected list."""
    return next((label for prefix, label in _KINDS if reason.startswith(prefix)), "other")


def _rank_of(reason: str) -> int:
    labels = [label for _, label in _KINDS]
    kind = reason_kind(reason)
    return labels.index(kind) if kind in labels else len(labels)


# ---- CLI ----------------------------------------------------------------------------------
def _row(e: Estimate, mark: str, unit: float = GB) -> str:
    return (f"{mark:1s} {str(e.layout):50s} {e.params / unit:6.1f} {e.grads / unit:6.1f} {e.optimizer / unit:6.1f} "
            f"{e.activations / unit:6.1f} {e.memory / unit:7.1f} {sum(e.comm.values()) / unit:8.2f} "
            f"{100 * e.bubble:6.1f} {e.step_time:8.2f}")


def format_plan(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, best: Estimate | None,
                rejected: list[Estimate], rows: int = 15, contenders: int = 5, per_kind: int = 2) -> str:
    dropout = model.dropout if train.dropout is None else train.dropout
    unit, u = (GB, "GB") if cluster.gpu_mem_bytes >= 10 * GB else (1e6, "MB")  # a small machine's run: MB
    lines = [f"model: {model.name + ', ' if model.name else ''}{model.params / 1e9:.2f}B params, {model.layers} "
             f"layers, hidden {model.hidden}, {model.n_heads} heads ({model.n_kv_heads} kv, head dim {model.d_head}), "
             f"{model.mlp} ffn {model.ffn_width}"
             + (f" x {model.experts} experts ({model.experts_per_token} per token)" if model.experts else "")
             + f", vocab {model.vocab} ({'tied' if model.tied else 'untied'} head), "
             f"seq {model.seq}",
             f"cluster: {cluster.gpus} GPUs ({cluster.gpus_per_node}/node, {cluster.gpu_mem_bytes / GB:.3g} GB, "
             f"{cluster.flops / 1e12:.3g} TFLOP/s at {cluster.mfu:.0%}, {cluster.intra_node_bw / GB:.3g}/"
             f"{cluster.inter_node_bw / GB:.3g} GB/s intra/inter-node)",
             f"training: global batch {train.global_batch} sequences, {train.precision} precision Adam, "
             f"{'flash' if train.flash_attention else 'eager'} attention, dropout {'on' if dropout else 'off'}, "
             f"sequence parallel {'on' if train.sequence_parallel else 'off'}, recompute {train.recompute}", "",
             f"  {'layout':50s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'activ':>6s} {'peak':>7s} "
             f"{'comm':>8s} {'bubble':>6s} {'step':>8s}",
             f"  {'':50s} {u:>6s} {u:>6s} {u:>6s} {u:>6s} {u:>7s} {u + '/step':>8s} {'%':>6s} {'s (est)':>8s}"]
    shown = ([best] if best else []) + rejected[:rows - 1]
    lines += [_row(e, "*" if e is best else "", unit) for e in shown]
    lines.append("")
    if best:
        lines.append(f"recommended: {best.layout}, microbatch {best.micro_batch} sequences, est. "
                     f"{best.tflops_per_gpu(cluster.gpus):.3g} TFLOP/s per GPU")
        if best.modelled_only:
            lines.append(f"  note: {best.modelled_only}")
    else:
        lines.append("nothing fits: more GPUs, a smaller batch per microbatch, or a longer recompute/offload list")
    lines.append(f"rejected ({len(rejected)} layouts): the {contenders} closest, then each rule's first examples")
    lines += [f"  {str(e.layout):50s} {e.reason}" for e in rejected[:contenders]]
    rest = rejected[contenders:]
    for kind in dict.fromkeys(reason_kind(e.reason) for e in rest):
        group = [e for e in rest if reason_kind(e.reason) == kind]
        lines.append(f"  ... {len(group)} more rejected ({kind}), e.g.")
        lines += [f"    {str(e.layout):48s} {e.reason}" for e in group[:per_kind]]
    return "\n".join(lines)


def _optional_int(text: str) -> int | None:
    return None if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> dict | None:
    """The CLI; with --verify it returns the verify report (parallel_layers/_verify.py) too."""
    ap = argparse.ArgumentParser(prog="python -m parallel_layers.plan", description=__doc__.split("\n\n")[0])
    shape = ap.add_argument_group("model (--hf-config, or the shape by hand)")
    shape.add_argument("--hf-config", help="a Hugging Face config.json or model directory (llama, mistral, qwen2, "
                       "qwen3, gpt2, mixtral, qwen3_moe); replaces --params --layers --hidden --heads --kv-heads --ffn --vocab")
    shape.add_argument("--params", help="parameter count, e.g. 7e9 or 7B (default: counted from the shape)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--hidden", type=int)
    shape.add_argument("--seq", type=int, required=True, help="training sequence length")
    shape.add_argument("--heads", type=int, default=None, help="default hidden / 128")
    shape.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention, default = heads")
    shape.add_argument("--vocab", type=int, default=None, help="default 32000")
    shape.add_argument("--ffn", type=int, default=None, help="MLP width, default 4 * hidden")
    shape.add_argument("--mlp", choices=MLP_KINDS, default=None, help="default gelu")
    shape.add_argument("--untied", action="store_true", help="the LM head has its own weight")
    hw = ap.add_argument_group("cluster")
    hw.add_argument("--gpus", type=int, required=True)
    hw.add_argument("--gpus-per-node", type=int, required=True)
    hw.add_argument("--gpu", choices=sorted(GPU_PRESETS), help="datasheet memory, peak and bandwidths; the flags "
                    "below override them")
    hw.add_argument("--gpu-mem", help="e.g. 80GB (required without --gpu)")
    hw.add_argument("--tflops", type=float, default=None, help="dense 16-bit peak per GPU, default 989")
    hw.add_argument("--mfu", type=float, default=None, help="fraction of peak reached, default 0.5")
    hw.add_argument("--intra-node-bw", default=None, help="per GPU, per second, default 450GB (NVLink)")
    hw.add_argument("--inter-node-bw", default=None, help="per GPU, per second, default 50GB (InfiniBand)")
    hw.add_argument("--pcie-bw", default="25GB", help="per GPU to host, for optimizer offload")
    tr = ap.add_argument_group("training")
    tr.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    tr.add_argument("--precision", choices=list(_PRECISIONS), default=None, help="default mixed (fp32 with --verify)")
    tr.add_argument("--flash-attention", action="store_true", help="do not store the s x s attention scores")
    tr.add_argument("--no-dropout", action="store_true", help="default: the model's own dropout")
    tr.add_argument("--no-sequence-parallel", action="store_true")
    tr.add_argument("--recompute", choices=[*RECOMPUTE, "auto"], default="auto",
                    help="activation recomputation; auto: the least that fits")
    tr.add_argument("--offload", choices=["auto", "on", "off"], default="auto", help="optimizer state in host memory")
    tr.add_argument("--micro-batch", type=_optional_int, default=None, help="sequences per microbatch, or auto")
    tr.add_argument("--virtual-stages", type=_optional_int, default=None, help="interleaved chunks per rank, or auto")
    tr.add_argument("--context-parallel", type=_optional_int, default=1,
                    help="N or auto (modelled only: parallel_layers does not implement context parallel yet)")
    tr.add_argument("--zero", type=_optional_int, default=None, help="0-3, or auto")
    tr.add_argument("--expert-parallel", type=_expert_parallel_arg, default="auto", metavar="auto|on|off|EP",
                    help="a mixture of experts' experts spread over dp (on) or over groups of EP dp ranks (auto: "
                         "without, and over every EP dividing dp and the expert count)")
    ap.add_argument("--rows", type=int, default=15, help="table rows to print")
    ver = ap.add_argument_group("verify on this machine (parallel_layers/_verify.py)")
    ver.add_argument("--verify", type=int, nargs="?", const=3, default=None, metavar="N",
                     help="run the N (default 3) best layouts that fit --gpus local processes for a few steps and "
                     "print predicted vs measured peak memory and step time per rank; needs --hf-config")
    ver.add_argument("--verify-steps", type=int, default=3, help="steps per layout (the first is not timed)")
    ver.add_argument("--verify-timeout", type=float, default=600.0, help="seconds for all the runs, then they are killed")
    args = ap.parse_args(argv)
    if args.verify is not None:
        return _verify_main(ap, args)
    try:
        model = _model_from_args(ap, args)
        hw_args = {k: v for k, v in (("gpu_mem_bytes", args.gpu_mem and parse_size(args.gpu_mem)),
                                     ("flops", args.tflops and args.tflops * 1e12),
                                     ("intra_node_bw", args.intra_node_bw and parse_size(args.intra_node_bw)),
                                     ("inter_node_bw", args.inter_node_bw and parse_size(args.inter_node_bw)))
                   if v is not None}
        hw_args.update(mfu=0.5 if args.mfu is None else args.mfu, pcie_bw=parse_size(args.pcie_bw))
        if args.gpu:
            cluster = ClusterSpec.preset(args.gpu, args.gpus, args.gpus_per_node, **hw_args)
        elif "gpu_mem_bytes" not in hw_args:
            ap.error(f"give --gpu (one of {sorted(GPU_PRESETS)}) or --gpu-mem")
        else:
            cluster = ClusterSpec(args.gpus, args.gpus_per_node, **hw_args)
        train = _train_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        ap.error(str(err))
    best, rejected = recommend(model, cluster, train)
    print(format_plan(model, cluster, train, best, rejected, rows=args.rows))


def _expert_parallel_arg(text: str):
    if text in ("auto", "on", "off"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, on, off or a positive number of data-parallel ranks, got {text!r}")


def _train_from_args(args) -> TrainSpec:
    return TrainSpec(args.global_batch, args.precision or "mixed", False if args.no_dropout else None,
                     args.flash_attention, not args.no_sequence_parallel, args.recompute,
                     {"auto": None, "on": True, "off": False}[args.offload], args.micro_batch, args.virtual_stages,
                     args.context_parallel, args.zero,
                     expert_parallel={"auto": None, "on": True, "off": False}.get(args.expert_parallel,
                                                                                   args.expert_parallel))


def _verify_main(ap: argparse.ArgumentParser, args) -> dict:
    """--verify: plan for this machine (measured) and run the top layouts (parallel_layers/_verify.py)."""
    from parallel_layers import _verify

    if not args.hf_config:
        ap.error("--verify builds the model from a Hugging Face config: give --hf-config (a config.json or a "
                 "save_pretrained directory)")
    if args.gpus != args.gpus_per_node:
        ap.error(f"--verify runs --gpus local processes on this machine (one node): --gpus {args.gpus} must equal "
                 f"--gpus-per-node {args.gpus_per_node}")
    measured = {"--gpu": args.gpu, "--tflops": args.tflops, "--intra-node-bw": args.intra_node_bw,
                "--inter-node-bw": args.inter_node_bw, "--mfu": args.mfu}
    given = [flag for flag, value in measured.items() if value is not None]
    if given:
        ap.error(f"--verify measures this machine's GEMM rate and bandwidth; drop {given} (--gpu-mem may set the "
                 "memory per rank)")
    if args.precision == "mixed":
        ap.error("--verify trains in float32 (the worker's dtype): --precision fp32 or leave it out, got mixed")
    args.precision = "fp32"
    try:
        model = _model_from_args(ap, args)
        train = _train_from_args(args)
        report = _verify.verify(model, train, args.hf_config, args.gpus, top=args.verify, steps=args.verify_steps,
                                gpu_mem_bytes=args.gpu_mem and parse_size(args.gpu_mem),
                                timeout_s=args.verify_timeout, rows=args.rows)
    except (ValueError, FileNotFoundError) as err:
        ap.error(str(err))
    except _verify.VerifyError as err:
        raise SystemExit(str(err)) from None
    print(_verify.format_report(report))
    off = [row for row in _verify.compare(report) if abs(row["memory_ratio"] - 1) > _verify.MEMORY_RTOL]
    if not report["runs"]:
        raise SystemExit("--verify: no layout fits this machine and is runnable by parallel_layers (see above)")
    if off:
        raise SystemExit(f"--verify: measured peak memory is off the prediction by more than "
                         f"{_verify.MEMORY_RTOL:.0%} on {len(off)} rank(s): "
                         + "; ".join(f"{r['layout']} rank {r['rank']} x{r['memory_ratio']:.2f}" for r in off))
    return report


def _model_from_args(ap: argparse.ArgumentParser, args) -> ModelSpec:
    by_hand = {"--params": args.params, "--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads,
               "--kv-heads": args.kv_heads, "--vocab": args.vocab, "--ffn": args.ffn, "--mlp": args.mlp,
               "--untied": args.untied or None}
    if args.hf_config:
        given = [flag for flag, value in by_hand.items() if value is not None]
        if given:
            ap.error(f"--hf-config gives the model's shape; drop {given} (or drop --hf-config)")
        return ModelSpec.from_hf_config(args.hf_config, seq=args.seq)
    missing = [flag for flag in ("--layers", "--hidden") if by_hand[flag] is None]
    if missing:
        ap.error(f"the model's shape needs {missing} (or --hf-config)")
    return ModelSpec(parse_size(args.params) if args.params else None, args.layers, args.hidden, args.seq,
                     args.heads, args.vocab or 32000, args.ffn, args.kv_heads, None, args.mlp or "gelu",
                     not args.untied)


if __name__ == "__main__":
    main()
