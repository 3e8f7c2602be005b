"""A tiny parallel_layers.models.GPT (the model of examples/train_gpt.py, a list of layers
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

from parallel_layers import DataParallel, ZeRO, init_parallel, tensor_parallel
from parallel_layers.models import GPT, GPT_TP_PLAN, Block, GPTConfig
from parallel_layers.tensor_parallel import gather_full, tied_cross_entropy

VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 37, 6, 10, 2, 2, 8


class TinyGPT(GPT):
    """parallel_layers.models.GPT at these sizes, without QKV bias (its key bias's zero gradient
    makes Adam amplify rounding noise differently per layout), returning per-token losses;
    with a tp_group, converted by GPT_TP_PLAN."""

    def __init__(self, tp_group=None):
        super().__init__(GPTConfig(vocab=VOCAB, seq_len=SEQ, d_model=D, heads=HEADS, layers=LAYERS, qkv_bias=False))
        if tp_group is not None:
            tensor_parallel.parallelize(self, GPT_TP_PLAN, tp_group)

    def forward(self, ids, targets):  # -> per-token losses [seq, batch]
        return token_losses(super().forward(ids), targets, self.layers[-1].tokens)


def token_losses(logits, targets, tokens):
    return tied_cross_entropy(logits, targets.transpose(0, 1), tokens, reduction="none")


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
