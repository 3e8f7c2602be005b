"""A tiny GPT from the library's layers (as in examples/train_gpt.py, written as a list of layers
so it can be pipelined) and the layouts the checkpoint tests train it at.

Sizes are chosen to hit the awkward cases: vocab 37 is padded to 38 at tp=2; d_model 10 makes
ZeRO pad (a 37 x 10 embedding over 4 ranks is 92.5 elements each); the QKV weight is fused
(three blocks per TP rank); the head is tied to the embedding (two state_dict keys, one tensor).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers import ColumnParallelLinear, DataParallel, RowParallelLinear, ZeRO, init_parallel
from parallel_layers.tensor_parallel import VocabParallelEmbedding, gather_full, vocab_parallel_cross_entropy
from parallel_layers.tensor_parallel import vocab_parallel_logits

VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 37, 6, 10, 2, 2, 8


class Embed(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.tokens = VocabParallelEmbedding(VOCAB, D, tp_group=tp_group)
        self.pos = nn.Embedding(SEQ, D)
        with torch.no_grad():
            self.tokens.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, ids):  # [batch, seq] -> [seq, batch, D]
        return (self.tokens(ids) + self.pos(torch.arange(ids.shape[1]))).transpose(0, 1)


class Block(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.head_dim = D // HEADS
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # No QKV bias: the key bias's true gradient is zero (softmax ignores a per-query
        # constant), so its rounding noise, normalised by Adam, would differ by layout.
        self.qkv = ColumnParallelLinear(D, 3 * D, bias=False, fused_sizes=(D, D, D), tp_group=tp_group)
        self.proj = RowParallelLinear(D, D, tp_group=tp_group)
        self.up = ColumnParallelLinear(D, 4 * D, activation="gelu_tanh", tp_group=tp_group)
        self.down = RowParallelLinear(4 * D, D, tp_group=tp_group)

    def forward(self, x):  # [seq, batch, D]
        s, b, _ = x.shape
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(attn)
        return x + self.down(self.up(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, tokens: VocabParallelEmbedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(D)
        self.tokens = tokens  # tied to the embedding

    def forward(self, x):  # -> local logits [seq, batch, vocab / tp]
        return vocab_parallel_logits(self.ln_f(x), self.tokens)


class TinyGPT(nn.Module):
    def __init__(self, tp_group=None):
        super().__init__()
        embed = Embed(tp_group)
        self.layers = nn.ModuleList([embed] + [Block(tp_group) for _ in range(LAYERS)] + [Head(embed.tokens)])

    def forward(self, ids, targets):  # -> per-token losses [seq, batch]
        x = ids
        for layer in self.layers:
            x = layer(x)
        return token_losses(x, targets, self.layers[-1].tokens)


def token_losses(logits, targets, tokens):
    return vocab_parallel_cross_entropy(logits, targets.transpose(0, 1), tokens, reduction="none")


def batch(step: int, rows: int = BATCH):
    """The global batch of a training step (the same on every rank), ids and targets [rows, SEQ]."""
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return ids[:, :-1], ids[:, 1:]


EVAL_BATCH = batch(-1)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@dataclasses.dataclass
class Run:
    model: TinyGPT  # the unwrapped model
    wrapped: nn.Module  # what trains: the model, DataParallel or ZeRO
    optimizer: torch.optim.Optimizer
    tp_group: object
    dp: int
    dp_rank: int


def build(tp: int, dp: int, wrapper: str, seed: int) -> Run:
    """TinyGPT at tp x dp under `wrapper` ("none", "ddp", "zero1", "zero2", "zero3"); without
    torch.distributed (tp = dp = 1) an ordinary single-device model."""
    ctx = init_parallel(tp=tp, dp=dp, device="cpu") if dist.is_initialized() else None
    tp_group, dp_group = (ctx.tp_group, ctx.dp_group) if ctx else (None, None)
    torch.manual_seed(seed)
    model = TinyGPT(tp_group)
    if wrapper.startswith("zero"):
        zero = ZeRO(model, make_optimizer, stage=int(wrapper[-1]), group=dp_group, wrap=lambda m: isinstance(m, Block))
        return Run(model, zero, zero.optimizer, tp_group, dp, ctx.coordinate("dp"))
    wrapped = DataParallel(model, group=dp_group) if wrapper == "ddp" else model
    return Run(model, wrapped, make_optimizer(model.parameters()), tp_group, dp, ctx.coordinate("dp") if ctx else 0)


def train(run: Run, first: int, last: int) -> None:
    """Steps first .. last - 1; each dp rank takes its rows of the step's global batch."""
    for step in range(first, last):
        ids, targets = (t.chunk(run.dp)[run.dp_rank] for t in batch(step))
        run.wrapped(ids, targets).mean().backward()
        if isinstance(run.wrapped, ZeRO):
            run.wrapped.step()
            run.wrapped.zero_grad()
        else:
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)


def eval_losses(run: Run) -> torch.Tensor:
    with torch.no_grad():
        return run.wrapped(*EVAL_BATCH)


def full_params(run: Run) -> dict[str, torch.Tensor]:
    """The unparallelized state dict, gathered with the layers' own tools (not the checkpoint's)."""
    state = run.wrapped.full_state_dict() if isinstance(run.wrapped, ZeRO) else run.model.state_dict()
    originals = run.model.state_dict(keep_vars=True)
    out = {}
    for name, value in state.items():
        spec = getattr(originals[name], "tp_shard", None)
        value = gather_full(value, run.tp_group, spec) if spec is not None else value.detach().clone()
        out[name] = value[:VOCAB] if name.endswith("tokens.weight") else value
    return out


def rel_diff(a: dict, b: dict) -> float:
    """Largest max|a - b| / max|b| over the tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-30)).item()
               for k in a)


def portable(obj):
    """Tensors -> numpy arrays, recursively: results cross the process boundary by value (a
    tensor would travel as a shared-memory handle that dies with the worker)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def tensors(obj):
    """The inverse of `portable`."""
    if hasattr(obj, "__array__") and not isinstance(obj, (str, bytes)):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors(v) for v in obj)
    return obj
