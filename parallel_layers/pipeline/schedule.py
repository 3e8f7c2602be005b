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

Note [p2p rounds]: messages follow NCCL's point-to-point rules, which are stricter than
gloo's: no tags, the k-th send from rank a to rank b meets b's k-th receive from a, and a
send or receive blocks until its peer has issued the matching one, unless both are in one
batch (`batch_isend_irecv`, a ncclGroupStart/End), whose operations progress together.
Two neighbours that each issue a lone receive first (1F1B's steady state) deadlock.
So every message gets a round: the time its producing compute finishes on a timeline of
the compute order (`_timeline`). Each rank issues, between its computes, one batch per
round it takes part in: the round's sends and receives, sorted by what they carry. A rank
places round T after its computes that start before T and before those that start at T or
later, so the producer has run and the consumer has not. Every rank issues its rounds in
increasing T. No deadlock: take the smallest round T at which some rank's batch is stuck;
its peer's matching operation is in the peer's round-T batch; the peer is not stuck
earlier (T is the smallest) and not past T (its batch would have completed), so it has
issued that batch, and both complete. Each channel's messages are issued in the same
(T, item) order on both ends, so the k-th send meets the k-th receive. `validate` checks
all of it with a model of these rules (`simulate_p2p`), so a hand-made or future list
that breaks them is refused before it runs. Rounds stay separate batches even with no
compute between them: the first activation of a boundary may need a header round of its own
just before its round (Note [stage boundary contract] in _p2p.py), and a header must not
wait in one batch with a payload that the peer needs first.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

SCHEDULES = ("gpipe", "1f1b", "interleaved")

FORWARD, BACKWARD = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
BATCH = "BATCH"
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


@dataclasses.dataclass(frozen=True)
class Batch:
    """Sends and receives issued together, as one `batch_isend_irecv` (Note [p2p rounds])."""

    ops: tuple[Action, ...]
    kind = BATCH

    def __repr__(self) -> str:
        return "[" + " ".join(map(repr, self.ops)) + "]"


def p2p_ops(actions: list) -> list[Action]:
    """The sends and receives of one rank's action list, in issue order."""
    out: list[Action] = []
    for a in actions:
        out.extend(a.ops if a.kind == BATCH else [a] if a.kind in (SEND_F, RECV_F, SEND_B, RECV_B) else [])
    return out


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


def _timeline(order: list[list[tuple[str, int, int]]], stages: int) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(start, finish) of every F and B when each rank runs its computes in `order` as soon
    as their inputs exist, a forward costing 1 and a backward 2; raises ScheduleError if the
    order deadlocks."""
    ranks = len(order)
    times: dict[tuple[str, int, int], tuple[float, float]] = {}
    clock = [0.0] * ranks
    pc = [0] * ranks
    while any(pc[r] < len(order[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(order[r]):
                kind, k, i = order[r][pc[r]]
                if kind == FORWARD:
                    deps = [(FORWARD, k - 1, i)] if k > 0 else []
                else:
                    deps = [(FORWARD, k, i)] + ([(BACKWARD, k + 1, i)] if k < stages - 1 else [])
                if any(d not in times for d in deps):
                    break
                start = max([clock[r]] + [times[d][1] for d in deps])
                clock[r] = start + _DURATION[kind]
                times[(kind, k, i)] = (start, clock[r])
                pc[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("replay stalled: the compute order deadlocks")
    return times


def _item(a: Action) -> tuple[str, int, int]:
    """What a send or receive carries: ("act", stage, mb) for a forward's output, ("grad",
    stage, mb) for the gradient a backward sends to the stage before."""
    return ("act" if a.kind in (SEND_F, RECV_F) else "grad", a.stage, a.microbatch)


def _with_messages(order: list[list[tuple[str, int, int]]], ranks: int, stages: int) -> list[list]:
    """The computes in `order` with their messages in batched rounds (Note [p2p rounds]). A
    stage's neighbour on the same rank (only with p = 1) hands over in memory: no message."""
    times = _timeline(order, stages)
    rounds: list[dict[float, list[Action]]] = [defaultdict(list) for _ in range(ranks)]
    for r, computes in enumerate(order):
        for kind, k, i in computes:
            finish = times[(kind, k, i)][1]
            if kind == FORWARD and k < stages - 1 and stage_rank(k + 1, ranks) != r:
                dst = stage_rank(k + 1, ranks)
                rounds[r][finish].append(Action(SEND_F, k, i, dst))
                rounds[dst][finish].append(Action(RECV_F, k, i, r))
            elif kind == BACKWARD and k > 0 and stage_rank(k - 1, ranks) != r:
                dst = stage_rank(k - 1, ranks)
                rounds[r][finish].append(Action(SEND_B, k, i, dst))
                rounds[dst][finish].append(Action(RECV_B, k, i, r))
    lists: list[list] = []
    for r, computes in enumerate(order):
        pending = sorted(rounds[r].items())
        actions: list = []
        for kind, k, i in computes:
            while pending and pending[0][0] <= times[(kind, k, i)][0]:
                actions.append(Batch(tuple(sorted(pending.pop(0)[1], key=_item))))
            actions.append(Action(kind, k, i))
        actions.extend(Batch(tuple(sorted(ops, key=_item))) for _, ops in pending)
        lists.append(actions)
    return lists


def build_schedule(schedule: str, ranks: int, microbatches: int, virtual: int = 1) -> list[list]:
    """Per rank, its full action list, validated (see `validate`). The interleaved schedule
    uses Megatron's order when that is valid for (p, m, v), else the simulated one."""
    stages = ranks * virtual
    candidates = [compute_order(schedule, ranks, microbatches, virtual)]
    if schedule == "interleaved":
        candidates.insert(0, megatron_interleaved_order(ranks, microbatches, virtual))
    for n, order in enumerate(candidates):
        try:
            lists = _with_messages(order, ranks, stages)
            validate(lists, ranks, microbatches, virtual)
            return lists
        except ScheduleError:
            if n == len(candidates) - 1:
                raise
    raise AssertionError("unreachable")


def forward_only(lists: list[list]) -> list[list]:
    """Each rank's actions without the backward computes and the gradient messages: a step under
    no_grad (Parallelized.evaluate). Both ends of every gradient message go, so each pair of
    ranks still issues its remaining sends and receives in the same order; `validate(...,
    kinds=(FORWARD,))` checks the result against NCCL's rules as the full lists are checked."""
    out = []
    for actions in lists:
        mine: list = []
        for a in actions:
            if a.kind == BATCH:
                ops = tuple(op for op in a.ops if op.kind in (SEND_F, RECV_F))
                if ops:
                    mine.append(Batch(ops))
            elif a.kind not in (BACKWARD, SEND_B, RECV_B):
                mine.append(a)
        out.append(mine)
    return out


class ScheduleError(ValueError):
    """An action list that would deadlock, mismatch a message, or break a data dependency."""


def validate(lists: list[list], ranks: int, microbatches: int, virtual: int = 1,
             kinds: tuple[str, ...] = (FORWARD, BACKWARD)) -> int:
    """Check action lists against NCCL's point-to-point rules (Note [p2p rounds]) and the data
    flow; return the number of rounds `simulate_p2p` took.

    A lone SEND_* / RECV_* action is a batch of one (it blocks until its peer's matching
    operation is issued). Raises ScheduleError on a deadlock (naming each rank's blocked
    batch), a channel whose k-th send and k-th receive carry different things (out of
    order), a send without receive, a send before its compute, a compute whose input has
    not been received, or a stage and microbatch not computed exactly once on its rank (for
    each of `kinds`: the forwards only, for `forward_only`'s lists).
    """
    stages = ranks * virtual
    if len(lists) != ranks:
        raise ScheduleError(f"expected {ranks} action lists (one per rank), got {len(lists)}")
    units: list[list[list]] = []
    for r in range(ranks):
        have: set = set()  # ("act" | "grad", stage, mb) this rank holds
        done: set = set()
        mine: list[list] = []
        for a in lists[r]:
            ops = a.ops if a.kind == BATCH else [a] if a.kind in (SEND_F, RECV_F, SEND_B, RECV_B) else None
            if ops is None:
                _check_compute(a, r, ranks, stages, have, done)
                continue
            for op in ops:
                if op.kind in (SEND_F, SEND_B) and _item(op) not in have:
                    raise ScheduleError(f"rank {r} sends {op} before computing it")
            have.update(_item(op) for op in ops if op.kind in (RECV_F, RECV_B))
            mine.append([("send" if op.kind in (SEND_F, SEND_B) else "recv", op.peer, _item(op)) for op in ops])
        expected = {(kind, k, i) for kind in kinds for k in range(r, stages, ranks) for i in range(microbatches)}
        if done != expected:
            raise ScheduleError(f"rank {r} computes {sorted(done - expected)} it should not and misses "
                                f"{sorted(expected - done)}")
        units.append(mine)
    return simulate_p2p(units)


def simulate_p2p(units: list[list[list[tuple[str, int, object]]]]) -> int:
    """Run NCCL's point-to-point matching on what each rank issues; return the rounds taken.

    units[r] is rank r's sequence of batches, each a list of ("send" | "recv", peer, what).
    Per directed pair, the k-th send meets the k-th receive and must carry the same `what`
    (the content, or its size and dtype for recorded calls). Batches linked by matched
    operations complete together, once each is its rank's current batch; a rank issues its
    next batch only after the current one completed. Raises ScheduleError on a mismatch, an
    unmatched operation or a deadlock.
    """
    ranks = len(units)
    where: dict[tuple, list] = defaultdict(list)  # (src, dst, "send"|"recv") -> [(batch index, what)]
    for r, batches in enumerate(units):
        for b, ops in enumerate(batches):
            for kind, peer, what in ops:
                if not 0 <= peer < ranks or peer == r:
                    raise ScheduleError(f"rank {r} batch {b}: {kind} with peer {peer} (ranks are 0..{ranks - 1}, "
                                        "not itself)")
                key = (r, peer, "send") if kind == "send" else (peer, r, "recv")
                where[key].append((b, what))
    for (src, dst, kind) in list(where):
        if kind != "send":
            continue
        sends, recvs = where[(src, dst, "send")], where.get((src, dst, "recv"), [])
        for k, ((bs, ws), (br, wr)) in enumerate(zip(sends, recvs)):
            if ws != wr:
                raise ScheduleError(f"send #{k} from rank {src} to rank {dst} carries {ws} but rank {dst}'s "
                                    f"receive #{k} from rank {src} expects {wr}: sends and receives are out of "
                                    "order (NCCL matches them in issue order)")
        if len(sends) != len(recvs):
            extra = sends[len(recvs):] or recvs[len(sends):]
            side = "sent but never received" if len(sends) > len(recvs) else "received but never sent"
            raise ScheduleError(f"messages {side} between rank {src} and rank {dst}: {[w for _, w in extra]}")
    for (src, dst, kind), ops in where.items():
        if kind == "recv" and (src, dst, "send") not in where:
            raise ScheduleError(f"messages received but never sent between rank {src} and rank {dst}: "
                                f"{[w for _, w in ops]}")
    # Batches joined by matched operations complete together: NCCL only promises that a
    # group's operations progress together, not that one completes while a peer's batch
    # still waits on a third rank. So a set of batches linked by matches (a component)
    # completes when every one of them is its rank's current batch.
    component: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, batch) -> its root

    def root(x):
        while component.get(x, x) != x:
            x = component[x]
        return x

    for (src, dst, kind), ops in where.items():
        if kind == "send":
            for (bs, _), (br, _) in zip(ops, where[(src, dst, "recv")]):
                a, b = root((src, bs)), root((dst, br))
                if a != b:
                    component[a] = b
    members: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for r, batches in enumerate(units):
        for b in range(len(batches)):
            members[root((r, b))].append((r, b))
    pc = [0] * ranks
    rounds = 0
    while any(pc[r] < len(units[r]) for r in range(ranks)):
        ready = {root((r, pc[r])) for r in range(ranks) if pc[r] < len(units[r])}
        ready = [c for c in ready if all(pc[r] == b for r, b in members[c])]
        for c in ready:
            for r, _ in members[c]:
                pc[r] += 1
        rounds += 1
        if not ready:
            blocked = {r: units[r][pc[r]] for r in range(ranks) if pc[r] < len(units[r])}
            raise ScheduleError(f"deadlock: every unfinished rank waits for a peer to issue a matching send or "
                                f"receive: {blocked}")
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


def replay_makespan(lists: list[list], ranks: int, virtual: int = 1) -> float:
    """Time the action lists take when each rank runs its computes in order, as soon as their
    inputs exist, a forward costing 1 and a backward 2 (messages free): for bubble checks."""
    order = [[(a.kind, a.stage, a.microbatch) for a in actions if a.kind in (FORWARD, BACKWARD)] for actions in lists]
    return max((finish for _, finish in _timeline(order, ranks * virtual).values()), default=0.0)


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
