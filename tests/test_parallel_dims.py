"""ParallelDims validation and init_parallel's (pp, dp, tp) groups on real processes."""

import re

import pytest
import torch
import torch.distributed as dist

from parallel_layers import ParallelDims, init_parallel
from tests.dist_harness import run_distributed


def test_dims_product_must_match_world_size():
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world_size 8; .* valid values are "
                                         r"\[1, 2, 4, 8\]"):
        ParallelDims(dp=2, tp=2, pp=3, world_size=8)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_dims_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match=f"tp must be a positive integer, got {bad}"):
        ParallelDims(dp=1, tp=bad, pp=1, world_size=1)


def test_infer_dp_and_its_error():
    assert ParallelDims.infer(8, tp=2, pp=2) == ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    with pytest.raises(ValueError, match=r"tp\(3\) \* pp\(1\) = 3 does not divide world_size 8"):
        ParallelDims.infer(8, tp=3)


def _groups(rank, ws, tp, pp):
    ctx = init_parallel(tp=tp, pp=pp, device="cpu")
    out = {axis: dist.get_process_group_ranks(ctx.group(axis)) for axis in ("pp", "dp", "tp")}
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.tp_group)  # the groups work
    out["tp_sum"] = t.item()
    out["coords"] = tuple(ctx.coordinate(a) for a in ("pp", "dp", "tp"))
    return out


def test_tp_is_innermost_and_pp_outermost():
    results = run_distributed(_groups, 8, args=(2, 2))
    for rank, r in enumerate(results):
        pp, rem = divmod(rank, 4)
        dp, tp = divmod(rem, 2)
        assert r["coords"] == (pp, dp, tp)
        assert r["tp"] == [rank - tp, rank - tp + 1]  # adjacent ranks
        assert r["dp"] == [pp * 4 + tp, pp * 4 + 2 + tp]
        assert r["pp"] == [dp * 2 + tp, 4 + dp * 2 + tp]
        assert r["tp_sum"] == 2


def _axis_timeouts(rank, world):
    import time

    ctx = init_parallel(tp=2, device="cpu", timeout_s=2.0)
    # the world group is the harness's (created with 60 s), the axes of 2 of 4 ranks new groups:
    # timeout_s is every one's (Note [one timeout for every group])
    seconds = [_seconds(g) for g in (ctx.tp_group, ctx.dp_group, dist.group.WORLD)]
    if rank == 1:
        time.sleep(6)  # hung outside any collective, past the timeout
        return seconds, None
    if rank != 0:
        return seconds, None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=ctx.tp_group)
    except RuntimeError:
        return seconds, time.monotonic() - start
    return seconds, "returned"


def test_every_axis_group_times_out_after_timeout_s():
    """Review finding (helper-59): the mesh's axis groups smaller than the world got torch's
    default timeout (30 min on gloo), not timeout_s, so at tp2 x dp2 a hung rank held its tp
    peer for half an hour (Note [axis groups time out too] in parallel_dims.py)."""
    results = run_distributed(_axis_timeouts, 4, timeout_s=60)
    for seconds, _ in results:
        assert seconds == [2.0, 2.0, 2.0]
    waited = results[0][1]
    assert isinstance(waited, float) and waited < 5.0, waited


def _seconds(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _world_hang(rank, world, timeout_s):
    import time

    ctx = init_parallel(tp=2, device="cpu", timeout_s=timeout_s)
    seconds = [_seconds(g) for g in (ctx.tp_group, ctx.dp_group, dist.group.WORLD)]
    if rank == 1:
        time.sleep(6)  # hung outside any collective
        return seconds, None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))  # the world group's
    except RuntimeError:
        return seconds, time.monotonic() - start
    return seconds, "returned"


def test_an_existing_process_group_takes_timeout_s_and_lends_its_own_without_it():
    """Note [one timeout for every group]: a process group initialised before init_parallel kept
    its own timeout - torch's 30 min on gloo, the harness's 60 s here - so a world-sized collective
    waited that long for a hung rank whatever timeout_s said. Given, timeout_s is the world
    group's too (the peers of the hung rank fail within seconds); not given, the existing group's
    timeout is every axis group's."""
    (seconds, waited), *others = run_distributed(_world_hang, 4, args=(2.0,), timeout_s=60, collective_timeout_s=60)
    assert all(s == [2.0, 2.0, 2.0] for s, _ in [(seconds, waited), *others]), [seconds, *others]
    assert isinstance(waited, float) and waited < 5.0, waited
    kept = run_distributed(_lent, 4, collective_timeout_s=45)
    assert kept == [[45.0, 45.0, 45.0]] * 4, kept


def _lent(rank, world):
    ctx = init_parallel(tp=2, device="cpu")
    return [_seconds(g) for g in (ctx.tp_group, ctx.dp_group, dist.group.WORLD)]


def _every_backends_seconds(rank, world, timeout_s):
    ctx = init_parallel(tp=2, device="cpu", timeout_s=timeout_s)
    return [sorted({g._get_backend(torch.device(d)).options._timeout.total_seconds() for d in ("cpu", "cuda")})
            for g in (ctx.tp_group, ctx.dp_group, dist.group.WORLD)]


@pytest.mark.parametrize("timeout_s", [None, 3.0])
def test_a_world_group_of_two_backends_gives_every_group_one_timeout(timeout_s):
    """Note [axis groups time out too]: a world group of several backends ("cpu:gloo,cuda:nccl"
    on a GPU; two gloo ones here) has no one options type for init_device_mesh's override, and
    its axis groups kept torch's 30 min (review finding, helper-85)."""
    want = [timeout_s or 45.0]  # the group's backend for either device type
    assert run_distributed(_every_backends_seconds, 4, args=(timeout_s,), backend="cpu:gloo,cuda:gloo",
                           collective_timeout_s=45) == [[want] * 3] * 4


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), float("inf"), 1e15, "60", True])
def test_timeout_s_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match=r"timeout_s must be a positive number of seconds.* got " + re.escape(repr(bad))):
        init_parallel(device="cpu", timeout_s=bad)


def test_an_index_less_cuda_device_is_this_ranks_gpu(monkeypatch):
    # the README's --device cuda: torch.cuda.set_device refused "cuda" without an index
    from parallel_layers.parallel_dims import resolve_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cpu") == torch.device("cpu")
    for other in ("mps", "meta"):  # mps failed in torch.mps with an AttributeError; meta was taken
        with pytest.raises(ValueError, match=f"device must be 'cpu' \\(gloo\\) or 'cuda' / 'cuda:<index>' "
                                             f"\\(NCCL\\), got '{other}'"):
            resolve_device(other)
