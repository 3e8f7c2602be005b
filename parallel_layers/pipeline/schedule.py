"""Pipeline schedules as per-rank action lists, built, validated and simulated before anything runs.

Terms: p pipeline ranks, v virtual stages (model chunks) per rank, S = p * v stages in all,
m microbatches. Stage k lives on rank k % p as that rank's chunk k // p (Megatron's
interleaved assignment; with v = 1, stage k is rank k). F(k, i) is the forward of stage k
on microbatch i, B(k, i) its backward.

Note [schedule construction]: the order of each rank's compute actions comes from one
discrete-time simulation of the whole pipeline, in which a forward takes one tick and a
backward two. Whenever a rank is idle it starts one F or B whose inputs were finished at
an earlier tick, picking by the schedule's policy:
  gpipe        every forward first (in microbatch order), then every backward
  1f1b         backward whenever one is ready, else a forward while fewer than the rank's
               in-flight limit (p - rank) are waiting for their backward
  interleaved  1f1b over v chunks per rank, in Megatron's order (forwards in groups of p
               microbatches per chunk, backwards from the last chunk), in-flight limit
               2 (p - rank - 1) + (v - 1) p + 1. Used only where Megatron's own order
               (`megatron_interleaved_order`, the better one) would deadlock: when the last
               group has fewer than p microbatches, for some p, m, v.
If at some tick every rank is idle with nothing runnable while work remains (possible only
when a limit is too tight for odd m), the limits are lifted for that tick, so every schedule
finishes for every p, v, m. Because each rank's order is a slice of one feasible global
timeline, running it with non-blocking sends and blocking receives cannot deadlock.
`validate` re-checks that independently on the final action lists.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque

SCHEDULES = ("gpipe", "1f1b", "interleaved")

FORWARD, BACKWARD = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
_DURATION = {FORWARD: 1, BACKWARD: 2}  # ticks: a backward costs about two forwards


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # F, B, SEND_F, RECV_F, SEND_B, RECV_B
    stage: int  # the stage computing (F, B) or whose activation / gradient travels
    microbatch: int
    peer: int | None = None  # the other rank of a send or receive

    def __repr__(self) -> str:
        peer = f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}" if self.peer is not None else ""
        return f"{self.kind}({self.stage},{self.microbatch}){peer}"


def stage_rank(stage: int, ranks: int) -> int:
    return stage % ranks


def check_arguments(schedule: str, ranks: int, microbatches: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (("pipeline size", ranks), ("microbatches", microbatches), ("virtual stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule != "interleaved" and virtual != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank (virtual=1), got virtual={virtual}; "
                         "use schedule='interleaved' for several chunks per rank")


def _in_flight_limit(schedule: str, rank: int, ranks: int, microbatches: int, virtual: int) -> int:
    if schedule == "gpipe":
        return microbatches * virtual
    if schedule == "1f1b":
        return ranks - rank
    return 2 * (ranks - rank - 1) + (virtual - 1) * ranks + 1


def _priority(kind: str, stage: int, mb: int, ranks: int, virtual: int, schedule: str) -> tuple:
    chunk = stage // ranks
    if schedule == "gpipe":
        return (kind != FORWARD, mb, chunk)
    if kind == FORWARD:
        return (mb // ranks, chunk, mb)
    return (mb // ranks, virtual - 1 - chunk, mb)


def compute_order(schedule: str, ranks: int, microbatches: int, virtual: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank, the order of its F and B actions as (kind, stage, microbatch); see the Note."""
    check_arguments(schedule, ranks, microbatches, virtual)
    stages = ranks * virtual
    done_at: dict[tuple[str, int, int], int] = {}
    todo = [{(kind, k, i) for kind in (FORWARD, BACKWARD) for k in range(r, stages, ranks)
             for i in range(microbatches)} for r in range(ranks)]
    in_flight = [0] * ranks
    forwards_left = [len(t) // 2 for t in todo]
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]

    def ready(task, tick):
        kind, k, i = task
        if kind == FORWARD:
            deps = [(FORWARD, k - 1, i)] if k > 0 else []
        else:
            deps = [(FORWARD, k, i)] + ([(BACKWARD, k + 1, i)] if k < stages - 1 else [])
        return all(done_at.get(d, tick) < tick for d in deps)

    busy_until = [0] * ranks
    tick = 0
    while any(todo):
        ran = []
        for lift in (False, True):
            for r in range(ranks):
                if busy_until[r] > tick:
                    continue
                limit = _in_flight_limit(schedule, r, ranks, microbatches, virtual)
                candidates = []
                for task in todo[r]:
                    if not ready(task, tick):
                        continue
                    if task[0] == FORWARD and in_flight[r] >= limit and not lift:
                        continue
                    if task[0] == BACKWARD and schedule == "gpipe" and forwards_left[r] and not lift:
                        continue
                    candidates.append(task)
                if not candidates:
                    continue
                prefer_backward = schedule != "gpipe"
                task = min(candidates, key=lambda t: ((t[0] == FORWARD) if prefer_backward else 0,
                                                      _priority(*t, ranks, virtual, schedule)))
                ran.append((r, task))
            if ran or any(b > tick for b in busy_until):
                break
        if not ran and not any(b > tick for b in busy_until):
            raise AssertionError(f"schedule construction stalled at tick {tick}: {todo}")
        for r, task in ran:
            todo[r].discard(task)
            busy_until[r] = tick + _DURATION[task[0]]
            done_at[task] = busy_until[r] - 1
            order[r].append(task)
            if task[0] == FORWARD:
                in_flight[r] += 1
                forwards_left[r] -= 1
            else:
                in_flight[r] -= 1
        tick += 1
    return order


def megatron_interleaved_order(ranks: int, microbatches: int, virtual: int) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B: forwards in groups of p microbatches per chunk, backwards
    likewise from the last chunk; (p - rank - 1) * 2 + (v - 1) * p warm-up forwards, then one
    forward and one backward in turn. Its bubble is (p - 1) / (v m) of the compute; with a
    last group of fewer than p microbatches it can deadlock (build_schedule then falls back)."""
    p, m, v = ranks, microbatches, virtual
    groups = [list(range(start, min(start + p, m))) for start in range(0, m, p)]
    order = []
    for r in range(p):
        fwd = [(FORWARD, c * p + r, i) for g in groups for c in range(v) for i in g]
        bwd = [(BACKWARD, c * p + r, i) for g in groups for c in reversed(range(v)) for i in g]
        warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        steady = [t for j in range(m * v - warmup) for t in (fwd[warmup + j], bwd[j])]
        order.append(fwd[:warmup] + steady + bwd[m * v - warmup:])
    return order


def _with_messages(order: list[list[tuple[str, int, int]]], ranks: int, stages: int) -> list[list[Action]]:
    """Each compute preceded by its receive and followed by its send. A stage's neighbour on
    the same rank (only with p = 1) hands over in memory: no message for it."""
    lists: list[list[Action]] = []
    for r, computes in enumerate(order):
        actions: list[Action] = []
        for kind, k, i in computes:
            if kind == FORWARD:
                src, dst = stage_rank(k - 1, ranks), stage_rank(k + 1, ranks)
                if k > 0 and src != r:
                    actions.append(Action(RECV_F, k - 1, i, src))
                actions.append(Action(FORWARD, k, i))
                if k < stages - 1 and dst != r:
                    actions.append(Action(SEND_F, k, i, dst))
            else:
                src, dst = stage_rank(k + 1, ranks), stage_rank(k - 1, ranks)
                if k < stages - 1 and src != r:
                    actions.append(Action(RECV_B, k + 1, i, src))
                actions.append(Action(BACKWARD, k, i))
                if k > 0 and dst != r:
                    actions.append(Action(SEND_B, k, i, dst))
        lists.append(actions)
    return lists


def build_schedule(schedule: str, ranks: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per rank, its full action list, validated (see `validate`). The interleaved schedule
    uses Megatron's order when that is valid for (p, m, v), else the simulated one."""
    stages = ranks * virtual
    candidates = [compute_order(schedule, ranks, microbatches, virtual)]
    if schedule == "interleaved":
        candidates.insert(0, megatron_interleaved_order(ranks, microbatches, virtual))
    for n, order in enumerate(candidates):
        lists = _with_messages(order, ranks, stages)
        try:
            validate(lists, ranks, microbatches, virtual)
            return lists
        except ScheduleError:
            if n == len(candidates) - 1:
                raise
    raise AssertionError("unreachable")


class ScheduleError(ValueError):
    """An action list that would deadlock, mismatch a message, or break a data dependency."""


def validate(lists: list[list[Action]], ranks: int, microbatches: int, virtual: int = 1, *,
             in_order: bool = False) -> int:
    """Simulate the action lists with non-blocking sends and blocking receives.

    Messages are matched by what they carry (stage, microbatch, kind), as tagged gloo sends
    are; with `in_order=True` a receive must also be the next message on its (sender,
    receiver) channel, as NCCL matches point-to-point messages in issue order. Raises
    ScheduleError on a deadlock (naming each rank's blocked action), an out-of-order message
    (in_order), a compute whose input is missing, or a stage and microbatch not computed
    exactly once on its rank. Returns the number of rounds the simulation took.
    """
    stages = ranks * virtual
    if len(lists) != ranks:
        raise ScheduleError(f"expected {ranks} action lists (one per rank), got {len(lists)}")
    channels: dict[tuple[int, int], deque] = defaultdict(deque)
    have: list[set] = [set() for _ in range(ranks)]  # what each rank holds: ("act"|"grad", stage, mb)
    done: list[set] = [set() for _ in range(ranks)]
    pc = [0] * ranks
    rounds = 0
    while any(pc[r] < len(lists[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(lists[r]):
                a = lists[r][pc[r]]
                if a.kind in (SEND_F, SEND_B):
                    item = ("act" if a.kind == SEND_F else "grad", a.stage, a.microbatch)
                    if item not in have[r]:
                        raise ScheduleError(f"rank {r} sends {a} before computing it")
                    channels[(r, a.peer)].append(item)
                elif a.kind in (RECV_F, RECV_B):
                    want = ("act" if a.kind == RECV_F else "grad", a.stage, a.microbatch)
                    chan = channels[(a.peer, r)]
                    if want not in chan:
                        break  # blocked until the sender gets there
                    if in_order and chan[0] != want:
                        raise ScheduleError(f"rank {r} expects {want} from rank {a.peer} but the next message on "
                                            f"that channel is {chan[0]}: sends and receives are out of order")
                    chan.remove(want)
                    have[r].add(want)
                else:
                    _check_compute(a, r, ranks, stages, have[r], done[r])
                pc[r] += 1
                progressed = True
        rounds += 1
        if not progressed:
            blocked = {r: lists[r][pc[r]] for r in range(ranks) if pc[r] < len(lists[r])}
            raise ScheduleError(f"deadlock: every unfinished rank waits on a receive: {blocked}")
    leftovers = {k: list(v) for k, v in channels.items() if v}
    if leftovers:
        raise ScheduleError(f"messages sent but never received: {leftovers}")
    for r in range(ranks):
        expected = {(kind, k, i) for kind in (FORWARD, BACKWARD) for k in range(r, stages, ranks)
                    for i in range(microbatches)}
        if done[r] != expected:
            raise ScheduleError(f"rank {r} computes {sorted(done[r] - expected)} it should not and misses "
                                f"{sorted(expected - done[r])}")
    return rounds


def _check_compute(a: Action, r: int, ranks: int, stages: int, have: set, done: set) -> None:
    if stage_rank(a.stage, ranks) != r:
        raise ScheduleError(f"rank {r} runs {a}, but stage {a.stage} lives on rank {stage_rank(a.stage, ranks)}")
    key = (a.kind, a.stage, a.microbatch)
    if key in done:
        raise ScheduleError(f"rank {r} runs {a} twice")
    if a.kind == FORWARD:
        if a.stage > 0 and ("act", a.stage - 1, a.microbatch) not in have:
            raise ScheduleError(f"rank {r} runs {a} without the activation of stage {a.stage - 1}")
        have.add(("act", a.stage, a.microbatch))
    else:
        if (FORWARD, a.stage, a.microbatch) not in done:
            raise ScheduleError(f"rank {r} runs {a} before its forward")
        if a.stage < stages - 1 and ("grad", a.stage + 1, a.microbatch) not in have:
            raise ScheduleError(f"rank {r} runs {a} without the gradient from stage {a.stage + 1}")
        have.add(("grad", a.stage, a.microbatch))
    done.add(key)


def replay_makespan(lists: list[list[Action]], ranks: int, virtual: int = 1) -> float:
    """Time the action lists take when each rank runs its computes in order, as soon as their
    inputs exist, a forward costing 1 and a backward 2 (messages free): for bubble checks."""
    stages = ranks * virtual
    finished: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * ranks
    todo = [[a for a in actions if a.kind in (FORWARD, BACKWARD)] for actions in lists]
    pc = [0] * ranks
    while any(pc[r] < len(todo[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(todo[r]):
                a = todo[r][pc[r]]
                k, i = a.stage, a.microbatch
                if a.kind == FORWARD:
                    deps = [(FORWARD, k - 1, i)] if k > 0 else []
                else:
                    deps = [(FORWARD, k, i)] + ([(BACKWARD, k + 1, i)] if k < stages - 1 else [])
                if any(d not in finished for d in deps):
                    break
                start = max([clock[r]] + [finished[d] for d in deps])
                clock[r] = finished[(a.kind, k, i)] = start + _DURATION[a.kind]
                pc[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("replay stalled: the lists deadlock")
    return max(clock)


def peak_in_flight(actions: list[Action]) -> int:
    """Most microbatches whose forward ran on this rank and whose backward has not (activations held)."""
    held = peak = 0
    for a in actions:
        if a.kind == FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind == BACKWARD:
            held -= 1
    return peak
