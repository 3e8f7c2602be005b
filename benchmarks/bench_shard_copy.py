"""Shard copy kernels: GB/s against the torch.cat / split equivalents and a plain copy.

    python benchmarks/bench_shard_copy.py [--world 4] [--reps 21] [--device cpu|cuda]

The tensors are one transformer layer's parameters (d_model 1024, MLP 4096, with biases
and odd sizes). For each kernel, in one interleaved run (median of --reps):
  ours        the fused op (one pass: cast, pad, interleave, scale)
  torch       what FSDP2-style code does with stock ops (cat / split_with_sizes_copy /
              _chunk_cat / _foreach_add_), including its separate cast pass
  copy        one contiguous copy_ of the same number of bytes: the memory-bandwidth limit
GB/s counts bytes read + written once. Writes benchmarks/results/bench_shard_copy.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, time_interleaved, write_json  # noqa: E402

import parallel_layers  # noqa: E402, F401
from parallel_layers.ops.shard_copy import all_gather_copy_out, reduce_scatter_copy_out, shard_numel  # noqa: E402

D, H = 1024, 4096
SHAPES = [(3 * D, D), (3 * D,), (D, D), (D,), (H, D), (H,), (D, H), (D,), (D,), (D,), (7, 13)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    w, dev = args.world, args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    fulls32 = [torch.randn(s, device=dev) for s in SHAPES]
    sizes = [shard_numel(t.numel(), w) for t in fulls32]
    total = sum(sizes)
    rank = 1
    shards32 = [torch.nn.functional.pad(t.flatten(), (0, s * w - t.numel())).chunk(w)[rank].contiguous()
                for t, s in zip(fulls32, sizes)]
    gathered16 = torch.randn(w, total, device=dev).to(torch.bfloat16)
    outs16 = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in SHAPES]
    grads16 = [t.to(torch.bfloat16) for t in fulls32]
    buf32 = torch.empty(w, total, device=dev)
    reduced32 = torch.randn(total, device=dev)
    shard_grads32 = [torch.zeros(s, device=dev) for s in sizes]
    src_limit, dst_limit = torch.empty(w * total, device=dev), torch.empty(w * total, device=dev)
    results = {}
    # Both sides write into preallocated buffers: a fresh multi-MB CPU allocation costs page
    # faults that would swamp the copies (a ZeRO wrapper keeps its buffers).
    ops = torch.ops.parallel_layers

    def run(name, fns, nbytes):
        limit = nbytes // 8  # float32 elements whose copy reads + writes the same bytes
        fns["copy"] = lambda: dst_limit[:limit].copy_(src_limit[:limit])
        t = time_interleaved(fns, args.reps, sync=sync)
        gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
        results[name] = {"seconds": t, "GB_per_s": gbs, "ours_over_torch_time": t["ours"] / t["torch"],
                         "ours_over_copy_time": t["ours"] / t["copy"]}
        print(f"{name:26s} ours {gbs['ours']:7.2f} GB/s  torch {gbs['torch']:7.2f} GB/s  copy {gbs['copy']:7.2f} GB/s"
              f"  | torch/ours time {t['torch'] / t['ours']:.2f}x, ours/copy time {t['ours'] / t['copy']:.2f}x")

    # all-gather copy-in: f32 shards -> bf16 row of the [W, S] buffer (mixed precision).
    ag_in = torch.empty(w, total, device=dev, dtype=torch.bfloat16)
    run("all_gather_copy_in", {
        "ours": lambda: ops.all_gather_copy_in(shards32, ag_in, rank),
        "torch": lambda: torch.cat([s.to(torch.bfloat16) for s in shards32], out=ag_in[rank]),
    }, total * (4 + 2))

    # all-gather copy-out: bf16 [W, S] -> unpadded bf16 params.
    def torch_copy_out():
        parts = gathered16.split(sizes, dim=1)  # per param: [W, s_i]
        for part, out in zip(parts, outs16):
            out.view(-1).copy_(part.reshape(-1)[:out.numel()])
    run("all_gather_copy_out", {"ours": lambda: all_gather_copy_out(gathered16, outs16), "torch": torch_copy_out},
        w * total * (2 + 2))

    # reduce-scatter copy-in: bf16 grads -> padded, interleaved, scaled f32 buffer.
    def torch_copy_in():
        torch._chunk_cat([g.flatten().float() for g in grads16], dim=0, num_chunks=w, out=buf32)
        buf32.mul_(0.25)
    run("reduce_scatter_copy_in", {"ours": lambda: ops.reduce_scatter_copy_in(grads16, buf32, 0.25),
                                   "torch": torch_copy_in},
        w * total * (2 + 4))

    # reduce-scatter copy-out: f32 chunk -> accumulate into f32 shard grads, post-scaled.
    run("reduce_scatter_copy_out", {
        "ours": lambda: reduce_scatter_copy_out(reduced32, shard_grads32, 0.5, True),
        "torch": lambda: torch._foreach_add_(shard_grads32, list(reduced32.split(sizes)), alpha=0.5),
    }, total * 4 * 3)

    path = write_json("bench_shard_copy", {"benchmark": "shard_copy", "machine": machine(), "world": w,
                                           "device": dev, "elements_per_rank": total, "kernels": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
