"""A small GPT, single-device model code written as a list of layers so it can be pipelined.

    model = GPT(GPTConfig(vocab=256, seq_len=64, d_model=64, heads=4, layers=2))
    loss = model.loss(model(ids), targets)                  # one process, as any nn.Module
    par = parallelize(model, ctx, tp_plan=GPT_TP_PLAN, optimizer=..., loss_fn=model.loss,
                      pipeline_layers="layers", ...)        # any layout

Layers: `Embed` (token embedding + learned positions; ids [batch, seq] -> x [seq, batch, d]),
`Block`s (attention with a fused QKV projection; a GeLU MLP), `Head` (final norm and the logits
of the head tied to the token embedding: [seq, batch, vocab]). Plain nn.Embedding / nn.Linear /
nn.LayerNorm; `GPT_TP_PLAN` makes it Megatron's tensor-parallel GPT:

  layers.0.tokens  VocabParallel()  the embedding's rows split over tp; the head, which reads it
                                    through `tied_logits` / `tied_cross_entropy`, follows: local
                                    logits [seq, batch, vocab / tp], vocabulary-parallel loss
  qkv              Column(fused=3)  each of q, k, v split on whole heads
  proj, down       "row"
  up               Column(activation="gelu_tanh")  GEMM + bias + GeLU in one kernel; the
                                    block's own `act` becomes the identity ("fused")
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from parallel_layers.tensor_parallel.plan import Column, VocabParallel
from parallel_layers.tensor_parallel.vocab import tied_cross_entropy, tied_logits


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    qkv_bias: bool = True  # False for exact parity checks under Adam: see Block


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        with torch.no_grad():  # GPT-2's 0.02 std
            self.tokens.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, ids: Tensor) -> Tensor:  # [batch, seq] -> [seq, batch, d]
        return (self.tokens(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))).transpose(0, 1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # The key bias's true gradient is zero (softmax ignores a per-query constant): its
        # rounding noise, normalised by Adam, differs by layout. qkv_bias=False drops it.
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)  # [q; k; v]
        self.proj = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:  # [seq, batch, d]
        s, b, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(attn)
        return x + self.down(self.act(self.up(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, d: int, tokens: nn.Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.tokens = tokens  # tied: the same module (and weight) as the embedding's

    def forward(self, x: Tensor) -> Tensor:  # [seq, batch, d] -> logits [seq, batch, vocab (/ tp)]
        return tied_logits(self.ln_f(x), self.tokens)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:  # targets [batch, seq]
        return tied_cross_entropy(logits, targets.transpose(0, 1), self.tokens)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
        self.cfg = cfg
        embed = Embed(cfg)
        self.layers = nn.ModuleList([embed] + [Block(cfg.d_model, cfg.heads, cfg.qkv_bias) for _ in range(cfg.layers)]
                                    + [Head(cfg.d_model, embed.tokens)])

    def forward(self, ids: Tensor) -> Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.layers[-1].loss(logits, targets)


# The tensor-parallel plan of the GPT above, for `parallelize(model, ctx, tp_plan=GPT_TP_PLAN)`.
GPT_TP_PLAN = {
    "layers.0.tokens": VocabParallel(),  # and the head tied to it
    "layers.*.qkv": Column(fused=3),
    "layers.*.proj": "row",
    "layers.*.up": Column(activation="gelu_tanh"),
    "layers.*.act": "fused",  # applied by `up` above
    "layers.*.down": "row",
}
