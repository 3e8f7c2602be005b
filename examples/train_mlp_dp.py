"""The main job, for now: train a small MLP built on the fused bias_gelu op with data
parallelism on N processes, and check it against the same training in one process.

    torchrun --standalone --nproc-per-node 2 examples/train_mlp_dp.py [--steps 20]

Every rank takes its slice of each global batch, gradients are averaged with all-reduce,
and all ranks step the same AdamW. At the end rank 0 replays the identical steps in a
single process on the whole batch and prints PASS if the parameters agree (float32;
the ranks' gradient sums differ from one big sum only by reduction order).
It grows into examples/train_gpt.py (tensor, pipeline and ZeRO parallelism).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import parallel_layers
from parallel_layers.ops import bias_gelu

# AdamW on float32: after the reduction-order differences of a few steps, parameters agree
# to about 1e-6 relative; 1e-4 leaves margin while still catching a wrong gradient.
PARITY_RTOL = 1e-4


class FusedMLP(nn.Module):
    """x -> Linear (no bias) -> fused bias + GeLU -> Linear."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden, bias=False)
        self.up_bias = nn.Parameter(torch.zeros(d_hidden))
        self.down = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.down(bias_gelu(self.up(x), self.up_bias, approximate="tanh"))


def make_data(steps: int, batch: int, d_in: int, d_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5
    xs = torch.randn(steps, batch, d_in, generator=g)
    return xs, torch.tanh(xs @ teacher)


def train(model, xs, ys, *, rank: int = 0, world: int = 1, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        loss = nn.functional.mse_loss(model(x[shard]), y[shard])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            dist.all_reduce(loss)
            loss /= world
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    d_in, d_out = 32, 8
    torch.manual_seed(0)
    model = FusedMLP(d_in, args.hidden, d_out)
    reference = copy.deepcopy(model)
    xs, ys = make_data(args.steps, args.batch_size, d_in, d_out)

    start = time.perf_counter()
    losses = train(model, xs, ys, rank=rank, world=world)
    elapsed = time.perf_counter() - start
    if rank == 0:
        info = parallel_layers.build_info()
        print(f"parallel_layers {parallel_layers.__version__}: {world} processes (gloo), "
              f"CUDA kernels compiled: {info['cuda_compiled']} {info['cuda_archs']}")
        for step in range(0, args.steps, max(1, args.steps // 5)):
            print(f"step {step:4d}  loss {losses[step]:.5f}")
        print(f"step {args.steps - 1:4d}  loss {losses[-1]:.5f}  ({elapsed:.2f} s, "
              f"{args.steps * args.batch_size / elapsed:.0f} samples/s)")
        ref_losses = train(reference, xs, ys)
        worst = max((p - q).abs().max().item() / max(q.abs().max().item(), 1e-12)
                    for p, q in zip(model.parameters(), reference.parameters()))
        ok = worst <= PARITY_RTOL and abs(losses[-1] - ref_losses[-1]) <= PARITY_RTOL * abs(ref_losses[-1])
        print(f"parity vs single process: final loss {losses[-1]:.6f} vs {ref_losses[-1]:.6f}, "
              f"max relative parameter difference {worst:.2e} (tolerance {PARITY_RTOL:g}): "
              f"{'PASS' if ok else 'FAIL'}")
        result = torch.tensor([1 if ok else 0])
    else:
        result = torch.tensor([0])
    dist.broadcast(result, src=0)
    dist.destroy_process_group()
    if not result.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
