"""Schedules as action lists: built, simulated and checked without any process."""

import dataclasses

import pytest
import torch.nn as nn

from parallel_layers.pipeline import Action, Batch, ScheduleError, balanced_split, build_schedule, validate
from parallel_layers.pipeline.schedule import (
    BATCH,
    compute_order,
    forward_only,
    p2p_ops,
    peak_in_flight,
    replay_makespan,
    simulate_p2p,
    stage_rank,
)
from parallel_layers.pipeline.stages import stage_bounds

ALL = [(s, p, m, v) for s in ("gpipe", "1f1b", "interleaved") for p in range(1, 8) for m in range(1, 12)
       for v in ((2, 3) if s == "interleaved" else (1,))]


@pytest.mark.parametrize("schedule,p,m,v", ALL)
def test_every_schedule_is_valid_for_any_stage_and_microbatch_count(schedule, p, m, v):
    # Passes the model of NCCL's point-to-point rules (issue order per pair, blocking until the
    # peer issues the match, batches progress together), the data flow, and each F/B once.
    lists = build_schedule(schedule, p, m, v)
    rounds = validate(lists, p, m, v)
    assert rounds >= 1 if p > 1 else rounds == 0
    for r, actions in enumerate(lists):
        computes = [a for a in actions if a.kind in ("F", "B")]
        assert len(computes) == 2 * m * v
        assert all(a.kind in ("F", "B", BATCH) for a in actions)  # no lone send or receive
        sends = sum(a.kind.startswith("SEND") for a in p2p_ops(actions))
        recvs = sum(a.kind.startswith("RECV") for a in p2p_ops(actions))
        # Stage 0 receives no activation, the last stage no gradient; with p = 1 nothing travels.
        assert sends == recvs == (0 if p == 1 else 2 * m * v - (m if r == 0 else 0) - (m if r == p - 1 else 0))
    # an evaluation's lists (no_grad): the forwards and their messages only, valid by the same rules
    forwards = forward_only(lists)
    validate(forwards, p, m, v, kinds=("F",))
    for r, actions in enumerate(forwards):
        assert [a for a in actions if a.kind in ("F", "B")] == [a for a in lists[r] if a.kind == "F"]
        assert all(op.kind in ("SEND_F", "RECV_F") for op in p2p_ops(actions))


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


def _unbatched(schedule, p, m, v=1):
    """The action lists as the runtime issued them before batching: each compute's receive as
    a lone operation right before it, its send right after (gloo matched them by tag)."""
    lists = []
    for r, computes in enumerate(compute_order(schedule, p, m, v)):
        actions = []
        for kind, k, i in computes:
            before, after = (k - 1, k + 1) if kind == "F" else (k + 1, k - 1)
            first, last = (k > 0, k < p * v - 1) if kind == "F" else (k < p * v - 1, k > 0)
            if first and stage_rank(before, p) != r:
                actions.append(Action("RECV_F" if kind == "F" else "RECV_B", before, i, stage_rank(before, p)))
            actions.append(Action(kind, k, i))
            if last and stage_rank(after, p) != r:
                actions.append(Action("SEND_F" if kind == "F" else "SEND_B", k, i, stage_rank(after, p)))
        lists.append(actions)
    return lists


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 4, 1), ("1f1b", 4, 7, 1), ("interleaved", 2, 8, 2)])
def test_unbatched_order_deadlocks_under_nccl_rules(schedule, p, m, v):
    # 1F1B's steady state: rank r sends an activation to r + 1 while r + 1 sends a gradient
    # to r; with blocking lone operations both wait for the other's receive. At p = 2 the
    # interleaved lists also receive on a channel in another order than it was sent.
    # (gpipe's lone operations happen to mirror; its runtime posted receives early instead.)
    with pytest.raises(ScheduleError, match="deadlock|out of order"):
        validate(_unbatched(schedule, p, m, v), p, m, v)


def test_nccl_model_matches_in_issue_order_and_batches_progress_together():
    send = lambda peer, what: ("send", peer, what)  # noqa: E731
    recv = lambda peer, what: ("recv", peer, what)  # noqa: E731
    # Both ranks send first: alone, each send waits for the other's receive (deadlock) ...
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_p2p([[[send(1, "a")], [recv(1, "b")]], [[send(0, "b")], [recv(0, "a")]]])
    # ... in one batch each, they progress together.
    assert simulate_p2p([[[send(1, "a"), recv(1, "b")]], [[send(0, "b"), recv(0, "a")]]]) == 1
    # Mirrored lone operations progress: rank 0 sends while rank 1 receives, then the reverse.
    assert simulate_p2p([[[send(1, "a")], [recv(1, "b")]], [[recv(0, "a")], [send(0, "b")]]]) >= 1
    # No tags: the k-th send meets the k-th receive, whatever they carry.
    with pytest.raises(ScheduleError, match="out of order"):
        simulate_p2p([[[send(1, "a"), send(1, "b")]], [[recv(0, "b"), recv(0, "a")]]])
    with pytest.raises(ScheduleError, match="sent but never received"):
        simulate_p2p([[[send(1, "a")]], [[]]])
    # A three-rank cycle of lone sends deadlocks; batched with the receives it does not.
    ring = [[[send((r + 1) % 3, r)], [recv((r - 1) % 3, (r - 1) % 3)]] for r in range(3)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_p2p(ring)
    assert simulate_p2p([[a + b for a, b in [ops]] for ops in ring]) == 1
    # NCCL promises only that a batch's operations progress together: rank 1's batch, which
    # also waits on rank 2, may hold up rank 0's first send. Matched batches complete together.
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_p2p([[[send(1, "x")], [send(2, "y")]], [[recv(0, "x"), recv(2, "z")]],
                      [[recv(0, "y")], [send(1, "z")]]])


def test_batches_pair_send_and_receive_in_the_steady_state():
    # 1F1B at p = 2: after warm-up, rank 0 sends an activation and receives a gradient in one
    # batch, the batch rank 1 mirrors with the same pair of operations.
    lists = build_schedule("1f1b", 2, 4)
    assert Batch((Action("SEND_F", 0, 2, 1), Action("RECV_B", 1, 1, 1))) in lists[0]
    assert Batch((Action("RECV_F", 0, 2, 0), Action("SEND_B", 1, 1, 0))) in lists[1]


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


def _without(actions, op):
    """The action list with the send or receive `op` taken out of its batch."""
    out = []
    for a in actions:
        if a.kind == BATCH:
            a = Batch(tuple(o for o in a.ops if o != op))
            if not a.ops:
                continue
        out.append(a)
    return out


def test_validator_finds_a_deadlock():
    # Rank 0 waits for microbatch 0's gradient before sending anything: rank 1 needs rank 0's
    # activation to produce it. (Receiving microbatch 1's activation before microbatch 0's is
    # caught earlier: out of order.)
    lists = build_schedule("1f1b", 2, 2)
    lists[0] = [Batch((Action("RECV_B", 1, 0, 1),))] + _without(lists[0], Action("RECV_B", 1, 0, 1))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lists, 2, 2)
    lists = build_schedule("1f1b", 2, 2)
    lists[1] = [Batch((Action("RECV_F", 0, 1, 0),))] + _without(lists[1], Action("RECV_F", 0, 1, 0))
    with pytest.raises(ScheduleError, match="out of order"):
        validate(lists, 2, 2)


def test_validator_finds_a_send_without_receive():
    lists = build_schedule("gpipe", 2, 2)
    lists[1] = _without(lists[1], Action("RECV_F", 0, 1, 0))
    with pytest.raises(ScheduleError, match="without the activation"):
        validate(lists, 2, 2)
    lists = build_schedule("gpipe", 2, 2)
    lists[0].append(Batch((Action("SEND_F", 0, 1, 1),)))
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
