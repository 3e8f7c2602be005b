"""The main job: train a small GPT with any mix of data, tensor, pipeline and ZeRO
parallelism, and check it against the same training in one process.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 2 --tp 2 --zero 1
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --dp 2 --tp 2 --pp 2 --microbatches 4
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py            # the reference

A training loop over `parallel_layers.parallelize(model, ctx, ...)`, which applies the layout
in the order of docs/parallelism.md: TP layers (--tp), this rank's pipeline stages (--pp,
--schedule, --microbatches, --virtual), DataParallel (--zero 0) or ZeRO (--zero 1-3; 1 is the
default with a pipeline) over the dp axis, and the pipeline schedule. The model
(parallel_layers.models.GPT) is single-device code; its plan GPT_TP_PLAN makes the embedding
and the head tied to it vocabulary-parallel (with vocabulary-parallel cross-entropy), the
fused QKV column-parallel and the attention output row-parallel, and the MLP Column(GeLU) ->
Row. Data: byte-level tokens of a
text generated from a fixed seed (nothing is downloaded), served by a DataLoader with a
DistributedSampler keyed on the data-parallel rank, so the TP and PP peers of one replica see
the same batch. --dtype bfloat16 runs forward and backward under autocast (float32 master
weights). At the end rank 0 replays the same global batches with the same model in one process
(same seed, same dtype) and prints PASS if the losses agree. Fault injection and a collective
timer for this script: parallel_layers/_debug.py.
"""

from __future__ import annotations

import argparse
import datetime
import random
import resource
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from parallel_layers import checkpoint, init_parallel, parallelize
from parallel_layers.models import GPT, GPT_TP_PLAN, Block, GPTConfig
from parallel_layers.pipeline import SCHEDULES

# float32, same seed and batches: the parallel run differs from the single process only in
# the order of sums (TP reductions, gradient averaging, microbatches); over the demo's steps
# the losses agree to ~1e-6 relative. 1e-4 leaves margin and still catches a wrong gradient.
# bfloat16 autocast rounds every matmul to 8 bits of mantissa, in a different order per
# layout: measured 0.7e-4 to 2.4e-4 over 30 steps (dp2 x tp2, pp2 interleaved); 3e-3 leaves
# margin for longer runs and still catches a wrong gradient (~1e-2 and more within steps).
PARITY_RTOL = {"float32": 1e-4, "bfloat16": 3e-3}


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


class StepSampler(DistributedSampler):
    """A DistributedSampler that starts at a given step and runs on across epochs: the data
    position is the step number alone, so a resumed run sees the batches it would have seen."""

    def __init__(self, dataset, *, batch_size: int, start_step: int = 0, **kwargs):
        super().__init__(dataset, shuffle=True, drop_last=True, **kwargs)
        self.batch_size, self.start_step = batch_size, start_step
        self.steps_per_epoch = self.num_samples // batch_size

    def __iter__(self):
        step = self.start_step
        while True:
            epoch, first = divmod(step, self.steps_per_epoch)
            self.set_epoch(epoch)
            indices = list(super().__iter__())
            yield from indices[first * self.batch_size:self.steps_per_epoch * self.batch_size]
            step = (epoch + 1) * self.steps_per_epoch


def batches(dataset, args, dp: int, dp_rank: int, start_step: int = 0, num_workers: int = 0):
    b = args.batch_size // dp
    sampler = StepSampler(dataset, batch_size=b, start_step=start_step, num_replicas=dp, rank=dp_rank,
                          seed=args.seed)
    return iter(DataLoader(dataset, batch_size=b, sampler=sampler, num_workers=num_workers))


# ---- training -----------------------------------------------------------------------------
def gpt(args) -> GPT:
    torch.manual_seed(args.seed)  # initialised on the CPU: the same weights at every layout
    return GPT(GPTConfig(vocab=256, seq_len=args.seq_len, d_model=args.d_model, heads=args.heads,
                         layers=args.layers))


def adamw(args):
    return lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)


def autocast(args):
    return torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")


def reference_losses(dataset, args, dp: int, device: torch.device) -> list[float]:
    """The same training in this one process: the model unparallelized, the global batches whole."""
    model = gpt(args).to(device)
    opt = adamw(args)(model.parameters())
    losses = []
    for per_rank in global_batches(dataset, args, dp):
        ids = torch.cat([b[0] for b in per_rank]).to(device)
        targets = torch.cat([b[1] for b in per_rank]).to(device)
        with autocast(args):
            loss = model.loss(model(ids), targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def global_batches(dataset, args, dp: int):
    """Per step, the batches of every dp rank, in rank order (what the ranks train on)."""
    loaders = [batches(dataset, args, dp, r) for r in range(dp)]
    for _ in range(args.steps):
        yield [next(it) for it in loaders]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / (tp * pp))")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                    help="0: DataParallel over dp; 1-3: ZeRO stage (default: 1 with --pp > 1, else 0)")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=None, help="per step (default: 2 * pp with --pp > 1, else 1)")
    ap.add_argument("--virtual", type=int, default=None, help="stages per rank (default: 2 for interleaved, else 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (one per --checkpoint-every "
                    "steps and one at the end)")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in "
                    "--checkpoint-dir (saved at any layout); start from scratch if there is none")
    args = ap.parse_args()
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise SystemExit("--resume and --checkpoint-every need --checkpoint-dir")
    args.zero = args.zero if args.zero is not None else (1 if args.pp > 1 else 0)
    args.microbatches = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    args.virtual = args.virtual or (2 if args.schedule == "interleaved" else 1)
    pipelined = args.pp > 1 or args.microbatches > 1

    ctx = init_parallel(tp=args.tp, pp=args.pp, dp=args.dp, device=args.device)
    # rank 0's one-process replay of the run may outlast a collective's timeout: the others wait
    # for its verdict on a group of their own (they failed a passing run after 10 minutes)
    verdict_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    rank, world, dp = dist.get_rank(), dist.get_world_size(), ctx.dims.dp
    if args.batch_size % (dp * args.microbatches):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by dp ({dp}) * microbatches "
                         f"({args.microbatches}) = {dp * args.microbatches}")
    dataset = Windows(generated_text(200_000), args.seq_len)
    model = gpt(args)
    par = parallelize(model, ctx, optimizer=adamw(args), loss_fn=model.loss, tp_plan=GPT_TP_PLAN,
                      zero_stage=args.zero, wrap=lambda m: isinstance(m, Block), pipeline_layers="layers",
                      schedule=args.schedule, microbatches=args.microbatches, virtual=args.virtual)
    # Checkpoints name tensors as the unparallelized GPT does ("layers.<i>..."), whatever the layout.
    losses, first = [], 0
    latest = checkpoint.latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if latest is not None:
        extra = checkpoint.load(latest, par.module, par.optimizer, prefix=par.prefix)
        losses, first = extra["losses"], extra["step"]
        if rank == 0:
            print(f"resumed from {latest} (step {first})")
    data = batches(dataset, args, dp, ctx.coordinate("dp"), first, args.num_workers)
    start = time.perf_counter()
    for i in range(first, args.steps):
        ids, targets = (t.to(ctx.device) for t in next(data))
        with autocast(args):
            mean = par.forward_backward(ids, targets).float().clone()
        par.step()
        par.zero_grad()
        dist.all_reduce(mean, group=ctx.dp_group)
        losses.append(mean.item() / dp)
        if args.checkpoint_dir and ((args.checkpoint_every and (i + 1) % args.checkpoint_every == 0)
                                    or i + 1 == args.steps):
            checkpoint.save(args.checkpoint_dir, i + 1, par.module, par.optimizer, prefix=par.prefix,
                            extra={"step": i + 1, "losses": losses})
        if rank == 0 and (i % max(1, args.steps // 10) == 0 or i == args.steps - 1):
            tok_s = (i + 1 - first) * args.batch_size * args.seq_len / (time.perf_counter() - start)
            bar = "#" * ((i + 1) * 30 // args.steps)
            print(f"\r[{bar:<30}] step {i + 1:4d}/{args.steps}  loss {losses[-1]:.4f}  {tok_s:8.0f} tok/s", flush=True)
    elapsed = time.perf_counter() - start
    # Peak memory: the process's resident set on the CPU, the allocator's peak on a GPU.
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20 if ctx.device.type == "cuda"
                         else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], device=ctx.device)
    peaks = [torch.zeros(1, device=ctx.device) for _ in range(world)]
    dist.all_gather(peaks, peak)

    verdict = torch.zeros(1)
    if rank == 0:
        ref_losses = reference_losses(dataset, args, dp, ctx.device)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        tolerance = PARITY_RTOL[args.dtype]
        ok = diff <= tolerance
        verdict[0] = float(ok)
        print()
        pipeline = (f", {args.schedule} schedule, {args.microbatches} microbatches"
                    + (f", {args.virtual} stages per rank" if args.virtual > 1 else "") if pipelined else "")
        print(f"layout: dp={dp} x tp={args.tp} x pp={args.pp} on {world} process(es), "
              f"{'ZeRO-' + str(args.zero) if args.zero else 'DataParallel' if dp > 1 else 'no data parallelism'}"
              f"{pipeline}, {args.dtype}")
        print(f"{'final loss':28s} {losses[-1]:.4f} (first {losses[0]:.4f})")
        ran = max(1, args.steps - first)
        print(f"{'throughput':28s} {ran * args.batch_size * args.seq_len / elapsed:.0f} tokens/s "
              f"({elapsed / ran * 1e3:.1f} ms/step)")
        print(f"{'peak memory per rank (MiB)':28s} " + ", ".join(f"{p.item():.0f}" for p in peaks))
        print(f"parity vs single process: final loss {losses[-1]:.6f} vs {ref_losses[-1]:.6f}, max relative "
              f"difference over {args.steps} steps {diff:.2e} (tolerance {tolerance:g}): {'PASS' if ok else 'FAIL'}")
    dist.broadcast(verdict, src=0, group=verdict_group)
    ctx.shutdown()
    if verdict.item() != 1.0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
