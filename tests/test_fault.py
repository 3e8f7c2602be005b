"""A dead, hung or out-of-step peer turns into an error naming the collective and the rank
(Note [collective watchdog] in parallel_layers/fault.py), within the process group's timeout."""

import datetime
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


def _held_up_in_another_group(rank, world):
    import torch.distributed as dist

    from parallel_layers.tensor_parallel import comm

    timeout = datetime.timedelta(seconds=4)
    pair_01, pair_12 = dist.new_group([0, 1], timeout=timeout), dist.new_group([1, 2], timeout=timeout)
    comm.all_reduce(torch.ones(4), None)  # every rank alive: heartbeats start
    if rank == 2:
        time.sleep(14)  # hangs in its own code
        return None
    if rank == 1:  # waits for rank 2 in their group (from 1 s to its diagnosis' end, ~7.5 s) ...
        time.sleep(1)
        return _survivor_message(lambda: comm.all_reduce(torch.ones(4), pair_12))
    # ... while rank 0 waits for rank 1 in theirs, times out at ~4 s and looks at rank 1 until ~6.5 s
    return _survivor_message(lambda: comm.all_reduce(torch.ones(4), pair_01))


def test_a_rank_held_up_in_another_groups_collective_is_not_called_out_of_order():
    """Review finding (helper-76): at tp2 x dp2 with one rank hung, a rank whose peer waited on it
    in another group's collective was told "the ranks disagree on the order of collectives"."""
    (message, _), (peer_message, _), _ = run_distributed(_held_up_in_another_group, 3, collective_timeout_s=4)
    assert message.startswith("all_reduce #1 of group [0, 1] failed on rank 0"), message
    assert "rank 1: alive but in all_reduce #1 of group [1, 2]" in message and "another group's" in message
    assert "disagree on the order" not in message
    assert "rank 2: alive but outside any collective" in peer_message


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


def test_nccl_env_defaults_fill_only_what_the_user_left_unset():
    from parallel_layers.fault import nccl_env_defaults

    env = {"HOME": "/home/u", "TORCHELASTIC_RUN_ID": "job7"}
    assert nccl_env_defaults(env) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_FR_DUMP_TEMP_FILE": "/home/u/.cache/torch/flight_recorder/job7/rank_"}
    # A value under any of torch's names for a variable wins, and is left as it is.
    user = {"HOME": "/home/u", "NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
            "XDG_CACHE_HOME": "/cache"}
    assert nccl_env_defaults(user) == {"TORCH_NCCL_ENABLE_MONITORING": "1"}
    assert nccl_env_defaults({"XDG_CACHE_HOME": "/cache"})["TORCH_FR_DUMP_TEMP_FILE"] == \
        "/cache/torch/flight_recorder/default/rank_"


def test_flight_recorder_prefix_follows_torch():
    from parallel_layers.fault import flight_recorder_prefix

    # torch 2.14's DebugInfoWriter: TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE, else the cache dir.
    assert flight_recorder_prefix({"HOME": "/home/u"}) == "/home/u/.cache/torch/comm_lib_trace_rank_"
    assert flight_recorder_prefix({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == "/c/torch/comm_lib_trace_rank_"
    assert flight_recorder_prefix({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/a/", "HOME": "/h"}) == "/a/"
    assert flight_recorder_prefix({"TORCH_FR_DUMP_TEMP_FILE": "/b/", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/a/"}) == "/b/"


def _nccl_failure(rank, world):
    from unittest import mock

    from parallel_layers import fault

    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = "/shared/fr/rank_"
    # The backend is gloo; the message is chosen by what the group reports.
    with mock.patch.object(fault.dist, "get_backend", lambda group=None: "nccl"):
        return _survivor_message(lambda: _raise_inside_collective(fault))[0]


def _raise_inside_collective(fault):
    with fault.collective("all_reduce", None):
        raise RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")


def test_collective_error_on_nccl_points_at_the_flight_recorder_dump():
    message, = run_distributed(_nccl_failure, 1)
    assert message.startswith("all_reduce #1 of group [0] failed on rank 0")
    assert "Cause: Watchdog caught collective operation timeout" in message
    assert "/shared/fr/rank_<rank> on its node (this rank: /shared/fr/rank_0)" in message
    assert "`torchfrtrace <dir>`" in message and "python -m torch.distributed.flight_recorder.fr_trace" in message


def _stop_and_restart(rank, world):
    from parallel_layers import fault
    from parallel_layers.tensor_parallel import comm

    comm.all_reduce(torch.ones(1), None)
    first = fault._local.heartbeat.thread
    alive = first.is_alive()
    fault.stop_heartbeat()  # joins: no thread left calling into the store
    stopped = not first.is_alive() and fault._local.heartbeat is None
    fault.stop_heartbeat()  # twice is fine
    comm.all_reduce(torch.ones(1), None)  # the next collective beats again
    return alive, stopped, fault._local.heartbeat.thread.is_alive() and fault._local.heartbeat.thread is not first


def test_heartbeat_stops_and_joins():
    assert run_distributed(_stop_and_restart, 2) == [(True, True, True)] * 2


def _reinit(rank, world, store_path):
    import torch.distributed as dist

    from parallel_layers import fault
    from parallel_layers.tensor_parallel import comm

    comm.all_reduce(torch.ones(1), None)
    first = fault._local.heartbeat.thread
    dist.destroy_process_group()  # a plain destroy: the heartbeat stops by itself within a beat
    first.join(timeout=2 * fault.HEARTBEAT_S + 1)
    stopped_by_itself = not first.is_alive()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    comm.all_reduce(torch.ones(1), None)  # beats for the new process group, into its store
    second = fault._local.heartbeat
    return stopped_by_itself, second.thread.is_alive(), second.world is dist.distributed_c10d.GroupMember.WORLD


def test_heartbeat_follows_a_new_process_group(tmp_path):
    assert run_distributed(_reinit, 2, args=(str(tmp_path / "store"),)) == [(True, True, True)] * 2
