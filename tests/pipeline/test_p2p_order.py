"""The point-to-point calls PipelineParallel really issues on gloo, checked against NCCL's rules.

Each rank records every send and receive its process group issues during real steps (at
`ProcessGroup.send` / `recv`, under every torch.distributed point-to-point API), grouped as
issued: the operations of one `batch_isend_irecv` form one unit, any other call a unit of
its own. The parent then runs the recorded calls through the model of
NCCL's semantics (`simulate_p2p`: no tags, the k-th send of a pair meets the k-th receive
and must have its size and dtype, a batch blocks until its peers issued the matching
operations): the sequences of every pair of ranks mirror and make progress, so the same
calls cannot deadlock or mismatch under NCCL (Note [p2p rounds] in schedule.py).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.pipeline import build_schedule
from parallel_layers.pipeline.runtime import evaluation_microbatches
from parallel_layers.pipeline.schedule import forward_only, p2p_ops, simulate_p2p
from tests.dist_harness import run_distributed

# (schedule, p, m, v): the cases the unbatched runtime failed (gpipe m=4, 1f1b m=4 and m=7 at
# p = 2 and 4, interleaved v=2 m=8 at p = 2), and odd m where the simulated orders are used.
CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 2, 7, 1), ("1f1b", 4, 7, 1),
         ("interleaved", 2, 8, 2), ("interleaved", 3, 5, 2)]


def _record(rank, world, schedule, m, v):
    import torch.distributed as dist

    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world * v - 2)]
    layers.append(nn.Linear(8, 3))
    pipe = PipelineParallel(PipelineStages(layers, virtual=v), schedule=schedule, microbatches=m,
                            loss_fn=F.cross_entropy)
    steps: list[list] = []
    batch: list | None = None  # the unit being issued by batch_isend_irecv, if any
    originals = dist.batch_isend_irecv, dist.ProcessGroup.send, dist.ProcessGroup.recv

    def batched(ops):
        nonlocal batch
        batch = []
        try:
            return originals[0](ops)
        finally:
            steps[-1].append(batch)
            batch = None

    def recorder(kind, original):
        def call(group, tensors, peer, tag):
            op = (kind, dist.get_global_rank(group, peer), (tensors[0].numel(), str(tensors[0].dtype)))
            (batch if batch is not None else steps[-1]).append(op if batch is not None else [op])
            return original(group, tensors, peer, tag)
        return call

    dist.batch_isend_irecv = batched
    dist.ProcessGroup.send, dist.ProcessGroup.recv = recorder("send", originals[1]), recorder("recv", originals[2])
    losses = []
    try:
        for n, grad in _steps(m):
            steps.append([])
            with torch.set_grad_enabled(grad):
                losses.append(pipe.step(*_batch(n)).item())
    finally:
        dist.batch_isend_irecv, dist.ProcessGroup.send, dist.ProcessGroup.recv = originals
    return steps, losses


def _steps(m):
    """(rows, grad) of each step. Steps 1 and 3 have inputs of a new shape (headers first), step 2
    repeats step 1's; step 4 is an evaluation (no_grad: the forwards and their messages only) of
    step 3's shape; step 5 an evaluation of 3m + 1 rows, which m does not divide (Note
    [evaluating any batch] in pipeline/runtime.py)."""
    return ((2 * m, True), (2 * m, True), (3 * m, True), (3 * m, False), (3 * m + 1, False))


def _batch(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_recorded_calls_follow_nccls_rules(schedule, p, m, v):
    results = run_distributed(_record, p, args=(schedule, m, v))
    recorded = [steps for steps, _ in results]
    lists = build_schedule(schedule, p, m, v)
    uneven = evaluation_microbatches(3 * m + 1, m)  # 13 rows at m = 4: one microbatch; 22 at m = 7: two
    for step in range(5):
        units = [recorded[r][step] for r in range(p)]
        assert simulate_p2p(units) >= 1  # raises on a mismatch, an unmatched operation or a deadlock
        for r in range(p):
            ops = sum(len(u) for u in units[r])
            scheduled = len(p2p_ops((forward_only(lists) if step == 3 else
                                     forward_only(build_schedule(schedule, p, uneven, v)) if step == 4 else lists)[r]))
            # A step with a known input shape issues exactly the schedule's operations, one per
            # transfer; a new shape adds one header per boundary this rank sends or receives on.
            boundaries = sum(1 for k in range(p * v - 1) if r in (k % p, (k + 1) % p) and k % p != (k + 1) % p)
            assert ops == scheduled + (boundaries if step in (0, 2, 4) else 0), (step, r)
    # the uneven evaluation's loss is the whole batch's, on every rank, as one process computes it
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(p * v - 2)]
    x, y = _batch(3 * m + 1)
    with torch.no_grad():
        expected = F.cross_entropy(nn.Sequential(*layers, nn.Linear(8, 3))(x), y).item()
    for _, losses in results:
        assert losses[4] == pytest.approx(expected, rel=1e-6), (losses, expected)
