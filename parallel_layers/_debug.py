"""Debug-only machinery, kept out of the programs a user copies: fault injection for the
crash-and-resume tests and a timer of blocking collectives. Both patch functions of a running
program from outside it; run that program through this module:

    torchrun --nproc-per-node 2 -m parallel_layers._debug --fault 1:5:train examples/train_gpt.py --dp 2 ...
    torchrun --nproc-per-node 8 -m parallel_layers._debug --time-collectives examples/train_gpt.py --pp 2 ...

--fault RANK:STEP:train SIGKILLs that rank as it starts training step STEP (1-based: the
STEP-th call of `Parallelized.forward_backward`, counted on from the step a checkpoint.load
returned in its extra["step"]); RANK:STEP:save SIGKILLs it in the middle of the checkpoint
save of step STEP, right after it wrote its own files (before the checkpoint is committed).
--time-collectives prints, at exit, each rank's wall time inside blocking collectives and
receives (async ones count when waited), peers' lateness included.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import signal
import sys
import time

import torch.distributed as dist

from parallel_layers import checkpoint
from parallel_layers.checkpoint import _io as checkpoint_io
from parallel_layers.parallelize import Parallelized


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject_fault(spec: str) -> None:
    """Arrange for this process to SIGKILL itself as `spec` ("RANK:STEP:train|save") says."""
    rank, step, phase = spec.split(":")
    if phase not in ("train", "save"):
        raise ValueError(f"fault phase must be 'train' or 'save', got {phase!r} in {spec!r}")
    if int(os.environ.get("RANK", "0")) != int(rank):
        return
    step = int(step)
    if phase == "train":
        started = {"step": 0}
        load, forward_backward = checkpoint.load, Parallelized.forward_backward

        def load_counting(*args, **kwargs):
            extra = load(*args, **kwargs)
            started["step"] = extra.get("step", 0) if isinstance(extra, dict) else 0
            return extra

        def forward_backward_or_die(self, *args, **kwargs):
            started["step"] += 1
            if started["step"] == step:
                _die()
            return forward_backward(self, *args, **kwargs)
        checkpoint.load, Parallelized.forward_backward = load_counting, forward_backward_or_die
        return
    save, record = checkpoint.save, checkpoint_io.record_written

    def save_then_die(directory, at_step, *args, **kwargs):
        if at_step == step:
            def record_then_die(*a):  # called once this rank's files are written
                record(*a)
                _die()
            checkpoint_io.record_written = record_then_die
        return save(directory, at_step, *args, **kwargs)
    checkpoint.save = save_then_die


class CollectiveTimer:
    """Wall time spent inside blocking collective calls (async ones count when waited)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single", "broadcast",
             "all_gather_object", "recv")

    def __init__(self):
        self.seconds = 0.0
        for name in self.NAMES:
            original = getattr(dist, name)

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                if not kwargs.get("async_op"):
                    self.seconds += time.perf_counter() - start
                return out
            setattr(dist, name, timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers._debug", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", default=None, metavar="RANK:STEP:train|save")
    ap.add_argument("--time-collectives", action="store_true")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.fault:
        inject_fault(args.fault)
    if args.time_collectives:
        timer, start = CollectiveTimer(), time.perf_counter()
        atexit.register(lambda: print(f"rank {os.environ.get('RANK', '0')}: {timer.seconds:.2f} s of "
                                      f"{time.perf_counter() - start:.2f} s in blocking collectives", flush=True))
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
