"""The distributed test harness: real gloo process groups, and failures instead of hangs."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import DistributedTestFailure, run_distributed


def _collectives(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    b = torch.tensor([42.0 if rank == 0 else -1.0])
    dist.broadcast(b, src=0)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "gathered": [g.item() for g in gathered], "bcast": b.item()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_smoke_collectives(world_size):
    results = run_distributed(_collectives, world_size)
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["world"] == world_size
        assert r["sum"] == world_size * (world_size + 1) / 2
        assert r["gathered"] == [float(i) for i in range(world_size)]
        assert r["bcast"] == 42.0


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def test_exception_carries_rank_and_traceback():
    with pytest.raises(DistributedTestFailure) as e:
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)
    msg = str(e.value)
    assert "rank 1 of 2 raised" in msg
    assert "ValueError: deliberate failure on rank 1" in msg
    assert "_raise_on_rank_1" in msg  # the traceback names the failing frame


def _killed_mid_collective(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return t.item()


def test_killed_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as e:
        run_distributed(_killed_mid_collective, 2, timeout_s=300, collective_timeout_s=300)
    # The dead rank is reported first, whether or not its peer noticed and raised already.
    assert str(e.value).startswith("rank 1 of 2 was killed by signal SIGKILL")
    # The acceptance bound: a dead rank becomes a failure in well under 2 minutes (it is seen
    # when its process exits, not by waiting for a timeout).
    assert time.monotonic() - start < 120


def _rank_0_waits_alone(rank, world_size):
    if rank == 0:
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 1 never joins
    else:
        time.sleep(3600)
    return rank


def test_hung_collective_times_out():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as e:
        run_distributed(_rank_0_waits_alone, 2, timeout_s=60, collective_timeout_s=5)
    # Rank 0's collective times out (gloo) and reports; rank 1 is killed by the harness.
    assert "rank 0 of 2 raised" in str(e.value)
    assert time.monotonic() - start < 60


def _never_returns(rank, world_size):
    time.sleep(3600)


def test_run_timeout_names_the_hung_ranks():
    with pytest.raises(DistributedTestFailure, match=r"ranks \[0, 1\] of 2 did not finish within 3 s"):
        run_distributed(_never_returns, 2, timeout_s=3)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_distributed(_collectives, 0)


def _rendezvous_flake_once(rank, world_size, marker):
    # The first attempt fails the way gloo's TCP rendezvous does; the retry must succeed.
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer")
    return rank


def test_gloo_rendezvous_flake_is_retried(tmp_path):
    with pytest.warns(RuntimeWarning, match="gloo rendezvous failed"):
        assert run_distributed(_rendezvous_flake_once, 2, args=(str(tmp_path / "failed-once"),)) == [0, 1]


def _other_failure_every_time(rank, world_size):
    raise RuntimeError("Connection closed by peer, but not while creating a group")


def test_other_failures_are_not_retried():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match="not while creating a group"):
        run_distributed(_other_failure_every_time, 2)
    assert time.monotonic() - start < 30
