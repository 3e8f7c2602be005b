"""The main job: train a small GPT with any mix of data, tensor and ZeRO parallelism, and
check it against the same training in one process.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 2 --tp 2 --zero 1
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py            # the reference

The model uses the library's layers: a vocabulary-parallel embedding and tied head with
vocabulary-parallel cross-entropy, attention with a fused column-parallel QKV and a
row-parallel output projection, and a Column(GeLU) -> Row MLP. Data: byte-level tokens of a
text generated from a fixed seed (nothing is downloaded), served by a DataLoader with a
DistributedSampler keyed on the data-parallel rank, so the TP peers of one replica see the
same batch. --zero 0 uses DataParallel over the dp axis, 1-3 the ZeRO stages. At the end rank
0 replays the same global batches with the same model in one process (tp = dp = 1, same
seed) and prints PASS if the losses agree. Pipeline parallelism (--pp) comes with the
pipeline wrappers.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from parallel_layers import ColumnParallelLinear, DataParallel, RowParallelLinear, ZeRO, init_parallel
from parallel_layers.tensor_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)

# float32, same seed and batches: the parallel run differs from the single process only in
# the order of sums (TP reductions, gradient averaging); over the demo's steps the final
# losses agree to ~1e-6 relative. 1e-4 leaves margin and still catches a wrong gradient.
PARITY_RTOL = 1e-4


# ---- data ---------------------------------------------------------------------------------
def generated_text(n_bytes: int, seed: int = 0) -> bytes:
    """Sentences from a small fixed grammar: structured enough to learn, made on the spot."""
    rng = random.Random(seed)
    subjects = ["the model", "a rank", "the gradient", "every shard", "the pipeline", "a tensor", "the optimizer"]
    verbs = ["gathers", "reduces", "scatters", "updates", "splits", "sends", "computes"]
    objects = ["the weights", "its shard", "a bucket", "the activations", "the loss", "every layer", "the batch"]
    out = []
    while sum(len(s) for s in out) < n_bytes:
        out.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}. ")
    return "".join(out).encode()[:n_bytes]


class Windows(torch.utils.data.Dataset):
    def __init__(self, data: bytes, seq_len: int):
        self.tokens = torch.tensor(list(data), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        chunk = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


# ---- model --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int, tp_group):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = ColumnParallelLinear(d, 3 * d, fused_sizes=(d, d, d), tp_group=tp_group)
        self.proj = RowParallelLinear(d, d, tp_group=tp_group)
        self.up = ColumnParallelLinear(d, 4 * d, activation="gelu_tanh", tp_group=tp_group)
        self.down = RowParallelLinear(4 * d, d, tp_group=tp_group)

    def forward(self, x):  # [seq, batch, d]
        s, b, _ = x.shape
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(attn)
        return x + self.down(self.up(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, heads: int, layers: int, tp_group):
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab, d, tp_group=tp_group)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, tp_group) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        with torch.no_grad():  # GPT-2's 0.02 std; elementwise, so the same at every TP size
            self.embed.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, ids, targets):  # ids, targets [batch, seq]
        x = (self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        logits = vocab_parallel_logits(self.ln_f(x), self.embed)  # [seq, batch, vocab / tp]
        return vocab_parallel_cross_entropy(logits, targets.transpose(0, 1), self.embed)


# ---- training -----------------------------------------------------------------------------
class CollectiveTimer:
    """Wall time spent inside blocking collective calls (async ones count when waited)."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "all_gather_object")

    def __init__(self):
        self.seconds = 0.0
        for name in self.NAMES:
            original = getattr(dist, name)

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                if kwargs.get("async_op"):
                    return out
                self.seconds += time.perf_counter() - start
                return out
            setattr(dist, name, timed)


def build(args, tp_group, dp_group, zero_stage, dp):
    torch.manual_seed(args.seed)
    model = GPT(256, args.seq_len, args.d_model, args.heads, args.layers, tp_group)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.0)  # noqa: E731
    if zero_stage:
        wrapped = ZeRO(model, make_opt, stage=zero_stage, group=dp_group,
                       wrap=lambda m: isinstance(m, Block))
        return wrapped, wrapped.step, wrapped.zero_grad
    wrapped = DataParallel(model, group=dp_group) if dp > 1 else model
    opt = make_opt(model.parameters())
    return wrapped, opt.step, lambda: opt.zero_grad(set_to_none=True)


def global_batches(dataset, args, dp: int):
    """Per step, the batches of every dp rank, in rank order (what the ranks train on)."""
    loaders = [iter(DataLoader(dataset, batch_size=args.batch_size // dp, drop_last=True,
                               sampler=DistributedSampler(dataset, num_replicas=dp, rank=r, shuffle=True,
                                                          seed=args.seed, drop_last=True)))
               for r in range(dp)]
    for _ in range(args.steps):
        yield [next(it) for it in loaders]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / (tp * pp))")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split over dp")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.pp != 1:
        raise SystemExit(f"--pp {args.pp}: pipeline parallelism is not available yet; use --pp 1")

    ctx = init_parallel(tp=args.tp, pp=args.pp, dp=args.dp, device=args.device)
    rank, world, dp = dist.get_rank(), dist.get_world_size(), ctx.dims.dp
    if args.batch_size % dp:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by dp = {dp}")
    timer = CollectiveTimer()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a group of one, for the reference
    dataset = Windows(generated_text(200_000), args.seq_len)
    model, step, zero_grad = build(args, ctx.tp_group, ctx.dp_group, args.zero, dp)
    dp_rank = ctx.coordinate("dp")
    loader = DataLoader(dataset, batch_size=args.batch_size // dp, drop_last=True, num_workers=args.num_workers,
                        sampler=DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True,
                                                   seed=args.seed, drop_last=True))
    losses, start, batches = [], time.perf_counter(), iter(loader)
    for i in range(args.steps):
        ids, targets = next(batches)
        loss = model(ids, targets)
        loss.backward()
        step()
        zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ctx.dp_group)
        losses.append(mean.item() / dp)
        if rank == 0 and (i % max(1, args.steps // 10) == 0 or i == args.steps - 1):
            tok_s = (i + 1) * args.batch_size * args.seq_len / (time.perf_counter() - start)
            bar = "#" * ((i + 1) * 30 // args.steps)
            print(f"\r[{bar:<30}] step {i + 1:4d}/{args.steps}  loss {losses[-1]:.4f}  {tok_s:8.0f} tok/s", flush=True)
    elapsed = time.perf_counter() - start
    comm = timer.seconds
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)

    verdict = torch.zeros(1)
    if rank == 0:
        ref, ref_step, ref_zero = build(args, solo, solo, 0, 1)
        ref_losses = []
        for per_rank in global_batches(dataset, args, dp):
            ids = torch.cat([b[0] for b in per_rank])
            targets = torch.cat([b[1] for b in per_rank])
            loss = ref(ids, targets)
            loss.backward()
            ref_step()
            ref_zero()
            ref_losses.append(loss.item())
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        ok = diff <= PARITY_RTOL
        verdict[0] = float(ok)
        print()
        print(f"layout: dp={dp} x tp={args.tp} x pp={args.pp} on {world} process(es), "
              f"{'ZeRO-' + str(args.zero) if args.zero else 'DataParallel' if dp > 1 else 'no data parallelism'}")
        print(f"{'final loss':28s} {losses[-1]:.4f} (first {losses[0]:.4f})")
        print(f"{'throughput':28s} {args.steps * args.batch_size * args.seq_len / elapsed:.0f} tokens/s "
              f"({elapsed / args.steps * 1e3:.1f} ms/step)")
        print(f"{'peak memory per rank (MiB)':28s} " + ", ".join(f"{p.item():.0f}" for p in peaks))
        print(f"{'time in collectives':28s} {comm:.2f} s of {elapsed:.2f} s on rank 0 "
              f"({100 * comm / elapsed:.0f}%), compute and the rest {elapsed - comm:.2f} s")
        print(f"parity vs single process: final loss {losses[-1]:.6f} vs {ref_losses[-1]:.6f}, max relative "
              f"difference over {args.steps} steps {diff:.2e} (tolerance {PARITY_RTOL:g}): {'PASS' if ok else 'FAIL'}")
    dist.broadcast(verdict, src=0)
    dist.destroy_process_group()
    if verdict.item() != 1.0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
