"""A small pre-LN transformer block (fused QKV attention + GeLU MLP) built from the TP layers
matches the single-process block - outputs, input and parameter gradients, parameters after
SGD steps - at tp = 1..4, with and without sequence parallelism."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sp,
    gather_full,
    reduce_grad_over_tp,
)
from tests.dist_harness import run_distributed

D, HEADS, HIDDEN, SEQ, BATCH = 24, 12, 48, 12, 2  # heads and seq divide by 1, 2, 3, 4
# float32; row layers and attention sum in another order than the single-process block.
RTOL = 2e-5


class Block(nn.Module):
    """Pre-LN block on [seq, batch, d] activations, written once for both layouts."""

    def __init__(self, qkv, proj, mlp_in, mlp_out):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj, self.mlp_in, self.mlp_out = qkv, proj, mlp_in, mlp_out

    def attention(self, qkv):  # [s, b, 3 * width] -> [s, b, width]; width = local heads * head_dim
        s, b, _ = qkv.shape
        q, k, v = (t.reshape(s, b, -1, D // HEADS).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x):
        x = x + self.proj(self.attention(self.qkv(self.ln1(x))))
        return x + self.mlp_out(self.mlp_in(self.ln2(x)))


def reference_block():
    torch.manual_seed(0)
    return Block(nn.Linear(D, 3 * D), nn.Linear(D, D),
                 nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(approximate="tanh")), nn.Linear(HIDDEN, D))


def tp_block(ref, group, sp):
    block = Block(ColumnParallelLinear.from_linear(ref.qkv, fused_sizes=(D, D, D), tp_group=group, sequence_parallel=sp),
                  RowParallelLinear.from_linear(ref.proj, tp_group=group, sequence_parallel=sp),
                  ColumnParallelLinear.from_linear(ref.mlp_in[0], activation="gelu_tanh", tp_group=group,
                                                   sequence_parallel=sp),
                  RowParallelLinear.from_linear(ref.mlp_out, tp_group=group, sequence_parallel=sp))
    block.ln1.load_state_dict(ref.ln1.state_dict())
    block.ln2.load_state_dict(ref.ln2.state_dict())
    if sp:  # the LayerNorms see only this rank's sequence chunk
        for p in [*block.ln1.parameters(), *block.ln2.parameters()]:
            reduce_grad_over_tp(p, group)
    return block


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _block_parity(rank, ws, sp, steps):
    group = dist.group.WORLD
    ref = reference_block()
    par = tp_block(ref, group, sp)
    ref_params = dict(ref.named_parameters())
    names = {"mlp_in.weight": "mlp_in.0.weight", "mlp_in.bias": "mlp_in.0.bias"}
    # SGD: the key bias has an exactly-zero true gradient (softmax ignores it), and Adam would
    # turn the rounding noise in it into full-size steps that differ between the two models.
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_par = torch.optim.SGD(par.parameters(), lr=0.05)
    local = (lambda t: t.chunk(ws, 0)[rank]) if sp else (lambda t: t)
    g = torch.Generator().manual_seed(1)
    worst = {}

    def check(name, got, want):
        worst[name] = max(worst.get(name, 0.0), _rel(got, want))

    for _ in range(steps):
        x = torch.randn(SEQ, BATCH, D, generator=g)
        w = torch.randn(SEQ, BATCH, D, generator=g)
        xr = x.clone().requires_grad_()
        out_ref = ref(xr)
        (out_ref * w).sum().backward()
        xp = local(x).clone().requires_grad_()
        out = par(xp)
        (out * local(w)).sum().backward()
        check("output", gather_from_sp(out.detach(), group) if sp else out.detach(), out_ref.detach())
        check("grad input", xp.grad, local(xr.grad))
        for name, p in par.named_parameters():
            spec = getattr(p, "tp_shard", None)
            full_grad = gather_full(p.grad, group, spec) if spec is not None else p.grad
            check(f"grad {name}", full_grad, ref_params[names.get(name, name)].grad)
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    for name, p in par.named_parameters():
        check(f"{name} after steps", gather_full(p, group), ref_params[names.get(name, name)].detach())
    return worst


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_block_matches_single_process(tp, sequence_parallel):
    for rank, worst in enumerate(run_distributed(_block_parity, tp, args=(sequence_parallel, 3))):
        bad = {k: v for k, v in worst.items() if not v < RTOL}
        assert not bad, f"rank {rank}: relative errors above {RTOL}: {bad}"
