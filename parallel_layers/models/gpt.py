"""A small GPT from the library's layers, written as a list of layers so it can be pipelined.

    model = GPT(GPTConfig(vocab=256, seq_len=64, d_model=64, heads=4, layers=2), tp_group=ctx.tp_group)
    loss = model.loss(model(ids), targets)                  # one process or tensor parallel
    par = parallelize(model, ctx, optimizer=..., loss_fn=model.loss, pipeline_layers="layers", ...)  # any layout

Layers: `Embed` (vocabulary-parallel token embedding + learned positions; ids [batch, seq] ->
x [seq, batch, d]), `Block`s (attention with a fused column-parallel QKV and a row-parallel
output projection; a Column(GeLU) -> Row MLP), `Head` (final norm and the logits of the head
tied to the token embedding, split on the vocabulary: [seq, batch, vocab / tp]). The loss is
the vocabulary-parallel cross-entropy. Initialisation does not depend on the TP size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from parallel_layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    qkv_bias: bool = True  # False for exact parity checks under Adam: see Block


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group):
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.vocab, cfg.d_model, tp_group=tp_group)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        with torch.no_grad():  # GPT-2's 0.02 std; elementwise, so the same at every TP size
            self.tokens.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, ids: Tensor) -> Tensor:  # [batch, seq] -> [seq, batch, d]
        return (self.tokens(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))).transpose(0, 1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, tp_group, qkv_bias: bool = True):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # The key bias's true gradient is zero (softmax ignores a per-query constant): its
        # rounding noise, normalised by Adam, differs by layout. qkv_bias=False drops it.
        self.qkv = ColumnParallelLinear(d, 3 * d, bias=qkv_bias, fused_sizes=(d, d, d), tp_group=tp_group)
        self.proj = RowParallelLinear(d, d, tp_group=tp_group)
        self.up = ColumnParallelLinear(d, 4 * d, activation="gelu_tanh", tp_group=tp_group)
        self.down = RowParallelLinear(4 * d, d, tp_group=tp_group)

    def forward(self, x: Tensor) -> Tensor:  # [seq, batch, d]
        s, b, _ = x.shape
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(attn)
        return x + self.down(self.up(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, d: int, tokens: VocabParallelEmbedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.tokens = tokens  # tied: the same module (and weight) as the embedding's

    def forward(self, x: Tensor) -> Tensor:  # [seq, batch, d] -> local logits [seq, batch, vocab / tp]
        return vocab_parallel_logits(self.ln_f(x), self.tokens)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:  # targets [batch, seq]
        return vocab_parallel_cross_entropy(logits, targets.transpose(0, 1), self.tokens)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group=None):
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
        self.cfg = cfg
        embed = Embed(cfg, tp_group)
        self.layers = nn.ModuleList([embed] + [Block(cfg.d_model, cfg.heads, tp_group, cfg.qkv_bias)
                                               for _ in range(cfg.layers)]
                                    + [Head(cfg.d_model, embed.tokens)])

    def forward(self, ids: Tensor) -> Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.layers[-1].loss(logits, targets)
