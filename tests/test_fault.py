"""A dead, hung or out-of-step peer turns into an error naming the collective and the rank
(Note [collective watchdog] in parallel_layers/fault.py), within the process group's timeout."""

import os
import signal
import time

import torch

from tests.dist_harness import run_distributed


def _survivor_message(fn):
    from parallel_layers.fault import CollectiveError

    start = time.monotonic()
    try:
        fn()
    except CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def _dead_peer(rank, world):
    from parallel_layers.tensor_parallel import comm

    comm.all_reduce(torch.ones(4), None)  # both ranks alive: heartbeats start
    time.sleep(1.5)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _survivor_message(lambda: comm.all_reduce(torch.ones(4), None))


def test_dead_rank_is_named():
    (message, seconds), dead = run_distributed(_dead_peer, 2, may_die=(1,))
    assert dead is None
    assert message.startswith("all_reduce #2 of group [0, 1] failed on rank 0")
    assert "rank 1 (pid" in message and "STOPPED - no heartbeat" in message
    assert "last seen outside any collective" in message
    assert seconds < 30  # gloo sees the closed connection at once; the diagnosis takes ~2.5 s


def _hung_peer(rank, world):
    from parallel_layers.tensor_parallel import comm

    comm.all_reduce(torch.ones(4), None)
    if rank == 1:
        time.sleep(12)  # "hangs" in its own code past the 4 s collective timeout
        return None
    return _survivor_message(lambda: comm.all_reduce(torch.ones(4), None))


def test_hung_rank_fails_the_others_within_the_timeout():
    (message, seconds), _ = run_distributed(_hung_peer, 2, collective_timeout_s=4)
    assert message.startswith("all_reduce #2 of group [0, 1] failed on rank 0")
    assert "rank 1: alive but outside any collective - it has not reached this one" in message
    assert 4 <= seconds < 20


def _out_of_step(rank, world):
    from parallel_layers.tensor_parallel import comm

    comm.all_reduce(torch.ones(4), None)
    if rank == 1:
        time.sleep(0.5)
        return _survivor_message(lambda: comm.all_gather(torch.ones(4), 0, None))
    return _survivor_message(lambda: comm.all_reduce(torch.ones(4), None))


def test_ranks_in_different_collectives_are_reported():
    (message, _), (peer_message, _) = run_distributed(_out_of_step, 2, collective_timeout_s=4)
    assert "rank 1: alive but in all_gather #2 of group [0, 1]" in message
    assert "the ranks disagree on the order of collectives" in message
    # Rank 1 fails too; whether it still sees rank 0 alive depends on who gives up first.
    assert peer_message.startswith("all_gather #2 of group [0, 1] failed on rank 1") and "rank 0" in peer_message


def _mismatched_replicas(rank, world):
    import torch.nn as nn

    from parallel_layers import DataParallel

    os.environ["PARALLEL_LAYERS_DEBUG"] = "1"
    model = nn.Linear(4, 3 if rank == 0 else 5)  # the replicas are not the same model
    try:
        DataParallel(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_debug_mode_checks_the_wrappers_collectives_too():
    expected = ("PARALLEL_LAYERS_DEBUG: ranks disagree on the next collective of group [0, 1]: rank 0: DataParallel "
                "parameter broadcast (3, 4) torch.float32; rank 1: DataParallel parameter broadcast (5, 4) "
                "torch.float32")
    assert run_distributed(_mismatched_replicas, 2, collective_timeout_s=20) == [expected, expected]
