"""Tensor-parallel MLP step time: ours vs PyTorch DTensor TP vs the single-process MLP.

    python benchmarks/bench_tp_mlp.py [--seq 256 --batch 4 --d-model 1024 --hidden 4096] [--reps 15]
                                      [--dtypes float32 bfloat16 autocast_bf16] [--trials 3]

Two processes on gloo (tp=2), one thread each. Per training step (grads set to None, then
forward + backward of x + MLP(x) - the MLP inside a residual, as in a transformer block, so
the output is consumed - on [seq, batch, d_model] activations that need their gradient,
with a dense output gradient), median of --reps, for each of --dtypes:
  ours:      parallel_layers ColumnParallelLinear(activation="gelu_tanh") + RowParallelLinear
  dtensor:   torch.distributed.tensor.parallel ColwiseParallel / RowwiseParallel on
             nn.Linear + nn.GELU(approximate="tanh") + nn.Linear
             (ours and dtensor interleaved round-robin)
  single:    the unsharded MLP in one process with both threads (rank 0, while rank 1 waits),
             timed in a separate phase after them: switching the thread count between
             interleaved steps perturbed the TP variants (OpenMP threads left spinning), so
             ratios to single carry more run-to-run noise than ours / dtensor
Each of --trials is a fresh pair of processes; a ratio is the median over trials of the
ratio within each trial (run-to-run spread on this VM is +-5%, so one trial cannot tell
0.79 from 0.83). bfloat16 is a pure-bf16 step (bf16 parameters and gradients, no autocast,
no float32 master weights); autocast_bf16 keeps float32 parameters and runs the forward under
torch.autocast(bfloat16), backward after it; all on CPU with gloo. Writes benchmarks/results/bench_tp_mlp.json
(every trial's times and ratios too). Target: ours / dtensor <= 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, spawn, time_interleaved, write_json  # noqa: E402


def _mlp(d_model: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d_model))


def _rank(rank, ws, seq, batch, d_model, hidden, reps, dtype_name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from parallel_layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    # "autocast_bf16": float32 parameters, forward under torch.autocast(bfloat16), backward after
    # the region closes - PyTorch's AMP recipe.
    use_autocast = dtype_name == "autocast_bf16"
    dtype = torch.float32 if use_autocast else getattr(torch, dtype_name)
    ref = _mlp(d_model, hidden).to(dtype)
    group = dist.group.WORLD
    ours = nn.Sequential(ColumnParallelLinear.from_linear(ref[0], activation="gelu_tanh", tp_group=group),
                         RowParallelLinear.from_linear(ref[2], tp_group=group))
    mesh = init_device_mesh("cpu", (ws,))
    dtensor = parallelize_module(_mlp(d_model, hidden).to(dtype), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # The input needs its gradient, as an MLP's does anywhere but at the very bottom of a
    # model: backward then has the grad-input all-reduce (ours overlaps it with the weight
    # gradient GEMM; DTensor runs it after).
    # The output's gradient is a dense tensor from the layer above (not a loss's sum, whose
    # gradient is a stride-0 expand that the GEMMs would first have to materialise).
    x = torch.randn(seq, batch, d_model, dtype=dtype, requires_grad=True)
    dy = torch.randn(seq, batch, d_model, dtype=dtype)

    def step(model):
        def run():  # a training step's gradient work: grads start as None (zero_grad's default)
            model.zero_grad(set_to_none=True)
            x.grad = None
            # The residual consumes the output: DTensor's RowwiseParallel returns it with its
            # all-reduce still in flight, and a bare backward from it would never wait for it.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
                out = x + model(x)
            out.backward(dy)
        return run

    times = time_interleaved({"ours": step(ours), "dtensor": step(dtensor)}, reps)
    dist.barrier()
    if rank == 0:  # alone, with both cores; rank 1 waits in the barrier so it takes no core away
        torch.set_num_threads(ws)
        times["single"] = time_interleaved({"single": step(ref)}, reps)["single"]
        torch.set_num_threads(1)
    dist.barrier()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "autocast_bf16"],
                    default=["float32", "bfloat16", "autocast_bf16"],
                    help="parameters, activations and gradients (bfloat16: a pure-bf16 step, no autocast; "
                         "autocast_bf16: float32 parameters, forward under bfloat16 autocast)")
    ap.add_argument("--trials", type=int, default=3, help="fresh process pairs; ratios are medians over them")
    ap.add_argument("--name", default="bench_tp_mlp", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    pairs = (("ours", "dtensor"), ("ours", "single"), ("dtensor", "single"))
    seconds, trials, trial_ratios, ratios = {}, {}, {}, {}
    for dtype in args.dtypes:
        # the slower rank's median of each variant, as the other distributed benchmarks take it
        runs = [{name: max(r[name] for r in ranks if name in r) for name in ranks[0]}  # "single": rank 0 alone
                for ranks in (spawn(_rank, 2, (args.seq, args.batch, args.d_model, args.hidden, args.reps, dtype))
                              for _ in range(args.trials))]
        trials[dtype] = runs
        # Each variant's median over trials on its own: these need not divide to `ratios`,
        # which are medians of the ratios within each trial (trial_ratios).
        seconds[dtype] = {name: statistics.median(t[name] for t in runs) for name in runs[0]}
        for a, b in pairs:
            trial_ratios[f"{a}_over_{b}_{dtype}"] = [t[a] / t[b] for t in runs]
            ratios[f"{a}_over_{b}_{dtype}"] = statistics.median(trial_ratios[f"{a}_over_{b}_{dtype}"])
        print(f"tp=2 MLP [{args.seq}x{args.batch}x{args.d_model}] -> {args.hidden} {dtype}, "
              f"fwd+bwd per step (the slower rank), {args.trials} trials:")
        for name in ("ours", "dtensor", "single"):
            print(f"  {name:8s} " + "  ".join(f"{t[name] * 1e3:8.2f}" for t in runs) + " ms")
        per_trial = ", ".join(f"{t['ours'] / t['dtensor']:.2f}" for t in runs)
        print(f"  ours / dtensor = {ratios[f'ours_over_dtensor_{dtype}']:.2f} (median of {per_trial}; target <= 0.8), "
              f"ours / single = {ratios[f'ours_over_single_{dtype}']:.2f}, "
              f"dtensor / single = {ratios[f'dtensor_over_single_{dtype}']:.2f}")
    path = write_json(args.name, {"benchmark": "tp_mlp", "machine": machine(), "args": vars(args),
                                  "seconds_per_step": seconds, "trials": trials, "trial_ratios": trial_ratios,
                                  "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
