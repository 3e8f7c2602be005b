"""Schedules as action lists: built, simulated and checked without any process."""

import dataclasses

import pytest
import torch.nn as nn

from parallel_layers.pipeline import Action, ScheduleError, balanced_split, build_schedule, validate
from parallel_layers.pipeline.schedule import compute_order, peak_in_flight, replay_makespan
from parallel_layers.pipeline.stages import stage_bounds

ALL = [(s, p, m, v) for s in ("gpipe", "1f1b", "interleaved") for p in range(1, 8) for m in range(1, 12)
       for v in ((2, 3) if s == "interleaved" else (1,))]


@pytest.mark.parametrize("schedule,p,m,v", ALL)
def test_every_schedule_is_valid_for_any_stage_and_microbatch_count(schedule, p, m, v):
    lists = build_schedule(schedule, p, m, v)  # validates: no deadlock, every send received, each F/B once
    assert validate(lists, p, m, v) > 0
    for r, actions in enumerate(lists):
        computes = [a for a in actions if a.kind in ("F", "B")]
        assert len(computes) == 2 * m * v
        sends = sum(a.kind.startswith("SEND") for a in actions)
        recvs = sum(a.kind.startswith("RECV") for a in actions)
        # Stage 0 receives no activation, the last stage no gradient; with p = 1 nothing travels.
        assert sends == recvs == (0 if p == 1 else 2 * m * v - (m if r == 0 else 0) - (m if r == p - 1 else 0))


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 5) for m in (1, 2, 3, 7, 9, 16)])
def test_activation_memory(p, m):
    # 1F1B: stage s holds at most p - s microbatches (memory grows with p, not m); GPipe holds all m.
    for r, actions in enumerate(build_schedule("1f1b", p, m)):
        assert peak_in_flight(actions) == min(p - r, m)
    for actions in build_schedule("gpipe", p, m):
        assert peak_in_flight(actions) == m


def test_1f1b_order_on_four_stages():
    order = compute_order("1f1b", 4, 6)
    fmt = [" ".join(f"{k}{i}" for k, _, i in rank) for rank in order]
    assert fmt[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"  # warm-up p - 1 forwards, then one F one B
    assert fmt[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


def test_interleaved_runs_the_forwards_in_megatron_order():
    order = compute_order("interleaved", 2, 4, 2)
    forwards = [(k, i) for kind, k, i in order[0] if kind == "F"]
    # Chunk 0 (stage 0) for microbatches 0, 1; chunk 1 (stage 2) for them; then microbatches 2, 3.
    assert forwards[:4] == [(0, 0), (0, 1), (2, 0), (2, 1)]


def test_nccl_order_check():
    # With p = 2 the two ranks are each other's previous and next stage: activations and
    # gradients share a channel, and with an odd m (the simulated order, Megatron's would
    # deadlock) they arrive in another order than they are received.
    with pytest.raises(ScheduleError, match="out of order"):
        validate(build_schedule("interleaved", 2, 5, 2), 2, 5, 2, in_order=True)
    for s, p, m, v in (("1f1b", 4, 5, 1), ("gpipe", 3, 5, 1), ("interleaved", 3, 5, 2), ("interleaved", 2, 4, 2)):
        validate(build_schedule(s, p, m, v), p, m, v, in_order=True)


@pytest.mark.parametrize("p,m,v", [(2, 8, 2), (4, 8, 2), (4, 16, 2), (3, 6, 2), (4, 8, 3)])
def test_interleaved_bubble_is_megatrons(p, m, v):
    # Replay the action lists with a forward costing 1 and a backward 2 (per chunk) and no
    # message latency: the idle fraction is (p - 1) / (v m + p - 1), Megatron's bubble.
    lists = build_schedule("interleaved", p, m, v)
    assert 1 - 3 * m * v / replay_makespan(lists, p, v) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_is_the_textbook_one(schedule):
    for p, m in ((2, 4), (4, 8), (3, 7)):
        lists = build_schedule(schedule, p, m)
        assert 1 - 3 * m / replay_makespan(lists, p, 1) == pytest.approx((p - 1) / (m + p - 1))


def _swap(actions, i, j):
    actions = list(actions)
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def test_validator_finds_a_deadlock():
    lists = build_schedule("1f1b", 2, 2)
    # Rank 1 waits for microbatch 1's activation before running microbatch 0: rank 0 only
    # sends it after the gradient of microbatch 0, which rank 1 never produces.
    lists[0] = [a for a in lists[0]]
    lists[1] = [Action("RECV_F", 0, 1, 0)] + [a for a in lists[1] if a != Action("RECV_F", 0, 1, 0)]
    lists[0] = [Action("RECV_B", 1, 0, 1)] + [a for a in lists[0] if a != Action("RECV_B", 1, 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lists, 2, 2)


def test_validator_finds_a_send_without_receive():
    lists = build_schedule("gpipe", 2, 2)
    lists[1] = [a for a in lists[1] if a != Action("RECV_F", 0, 1, 0)]
    with pytest.raises(ScheduleError, match="without the activation"):
        validate(lists, 2, 2)
    lists = build_schedule("gpipe", 2, 2)
    lists[0].append(Action("SEND_F", 0, 1, 1))
    with pytest.raises(ScheduleError, match="never received"):
        validate(lists, 2, 2)


def test_validator_finds_a_missing_or_misplaced_compute():
    lists = build_schedule("1f1b", 3, 3)
    lists[2] = [a for a in lists[2] if a != Action("B", 2, 2)]
    with pytest.raises(ScheduleError, match="sends SEND_B\\(2,2\\)->1 before computing it"):
        validate(lists, 3, 3)
    lists = build_schedule("1f1b", 3, 3)
    lists[0] = [a for a in lists[0] if a != Action("B", 0, 2)]
    with pytest.raises(ScheduleError, match="misses \\[\\('B', 0, 2\\)\\]"):
        validate(lists, 3, 3)
    lists = build_schedule("1f1b", 3, 3)
    lists[1] = [dataclasses.replace(a, stage=2) if a == Action("F", 1, 0) else a for a in lists[1]]
    with pytest.raises(ScheduleError, match="lives on rank 2"):
        validate(lists, 3, 3)


@pytest.mark.parametrize("bad,match", [
    (("pipedream", 2, 2, 1), "schedule must be one of"),
    (("1f1b", 2, 0, 1), "microbatches must be a positive integer, got 0"),
    (("1f1b", 2, 4, 2), "use schedule='interleaved'"),
])
def test_bad_schedule_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*bad)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5]
    assert balanced_split([1] * 8, 4) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 pipeline stages"):
        balanced_split([1, 2, 3], 4)


def test_split_counts_embedding_and_head():
    layers = [nn.Embedding(1000, 16)] + [nn.Linear(16, 16) for _ in range(6)] + [nn.Linear(16, 1000)]
    bounds = stage_bounds(layers, 3, None)
    # The 16k-parameter embedding and head each get a stage with few blocks.
    assert bounds == [(0, 1), (1, 7), (7, 8)]


@pytest.mark.parametrize("points,match", [
    ([2], "must give the first layer of stages 1..2"),
    ([3, 2], "strictly increasing layer indices in \\[1, 5\\]"),
    ([0, 3], "strictly increasing"),
    ([2, 6], "strictly increasing"),
])
def test_bad_split_points(points, match):
    layers = [nn.Linear(2, 2) for _ in range(6)]
    with pytest.raises(ValueError, match=match):
        stage_bounds(layers, 3, points)
