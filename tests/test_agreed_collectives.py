"""Agreed collectives (data_parallel.py Note [agreed bucket order], zero/api.py Note [agreed
reduction order]): a parameter unused on one rank only, and gradients arriving in another
order on each rank, leave every rank issuing the same collectives in the same order.

- Parity: a model with data-dependent branches taken on rank 1 only, under DataParallel and
  ZeRO stages 1-3 at world sizes 2 and 3, and under PipelineParallel (pp=2 x dp=2), against
  one process that averages each rank's gradient (zeros where that rank skipped) - SGD, so a
  wrong average shows in the parameters.
- The sequence (op, numel, dtype) of collectives each rank issues, recorded by patching
  torch.distributed in the test's worker processes, is the same on every rank.
- Stage 3 with a whole wrapped module skipped on one rank: with PARALLEL_LAYERS_DEBUG=1, an
  error on every rank.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers import DataParallel, ZeRO
from tests.dist_harness import run_distributed

RTOL = 1e-5  # float32: the ranks' gradients are summed in another order than the reference's
STEPS = 4
WRAPPERS = ["dp", "zero1", "zero2", "zero3"]


class Block(nn.Module):
    """A residual layer whose inner Linear is skipped when asked: a sub-module unused on a rank."""

    def __init__(self, width):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, h, skip=False):
        return h if skip else h + torch.tanh(self.inner(h))


class Branchy(nn.Module):
    """a -> b (its inner Linear skippable) -> c (skippable as a whole) -> d, times a root param."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(7, 16), Block(16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x, skip_inner=False, skip_c=False):
        h = self.b(torch.tanh(self.a(x)), skip=skip_inner)
        if not skip_c:
            h = torch.tanh(self.c(h))
        return self.d(h) * self.scale


def _skips(wrapper, rank):
    # Stage 3 supports a parameter or sub-module unused on one rank, not a whole wrapped module
    # (its all-gathers would not match: test_zero3_whole_module_skipped_is_an_error_on_every_rank).
    return {"skip_inner": rank == 1, "skip_c": rank == 1 and wrapper != "zero3"}


def _wrap(wrapper, model, group=None):
    """(wrapped model, optimizer step, zero_grad) for one of WRAPPERS, SGD at lr 0.1."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    if wrapper == "dp":
        wrapped = DataParallel(model, group=group, bucket_mb=0.001, first_bucket_mb=0.001)  # several buckets
        opt = sgd(model.parameters())
        return wrapped, opt.step, lambda: opt.zero_grad(set_to_none=True)
    wrapped = ZeRO(model, sgd, stage=int(wrapper[-1]), group=group,
                   wrap=lambda m: isinstance(m, (nn.Linear, Block)))
    return wrapped, wrapped.step, wrapped.zero_grad


def _reference_step(ref, opt, batches, flags):
    """One SGD step on the average over ranks of each rank's gradient (zeros where unused)."""
    grads = [torch.zeros_like(p) for p in ref.parameters()]
    for (x, y), skips in zip(batches, flags):
        ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(x, **skips), y).backward()
        for g, p in zip(grads, ref.parameters()):
            if p.grad is not None:
                g += p.grad / len(batches)
    for g, p in zip(grads, ref.parameters()):
        p.grad = g
    opt.step()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _parity(rank, ws, wrapper):
    torch.manual_seed(0)
    ref = Branchy()
    model, step, zero_grad = _wrap(wrapper, copy.deepcopy(ref))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    flags = [_skips(wrapper, r) for r in range(ws)]
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batches = [(torch.randn(6, 7, generator=g), torch.randn(6, 1, generator=g)) for _ in range(ws)]
        _reference_step(ref, opt_ref, batches, flags)
        x, y = batches[rank]
        F.mse_loss(model(x, **flags[rank]), y).backward()
        step()
        zero_grad()
    state = model.full_state_dict() if wrapper != "dp" else model.module.state_dict()
    return {k: _rel(v, ref.state_dict()[k]) for k, v in state.items()}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("ws", [2, 3])
def test_parameter_unused_on_one_rank_matches_single_process(ws, wrapper):
    for rank, errors in enumerate(run_distributed(_parity, ws, args=(wrapper,), timeout_s=120,
                                                  collective_timeout_s=30)):
        bad = {k: v for k, v in errors.items() if not v < RTOL}
        assert not bad, f"rank {rank}: relative errors above {RTOL}: {bad}"


# ---- the collectives each rank issues -------------------------------------------------------
_RECORDED = ("all_reduce", "broadcast", "reduce_scatter_single", "all_gather_single")


def _record_collectives(log):
    """Patch torch.distributed (in this worker process only) to append (op, numel, dtype) per
    call. ZeRO then issues the collectives NCCL runs, not gloo's copy-free sends and in-place
    all-reduces (zero/_group.py GLOO_DIRECT): the order under test is NCCL's."""
    from parallel_layers.zero import _group

    _group.GLOO_DIRECT = False
    for name in _RECORDED:
        original = getattr(dist, name)

        def recorded(*args, _name=name, _original=original, **kwargs):
            t = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
            log.append((_name, t.numel(), str(t.dtype)))
            return _original(*args, **kwargs)
        setattr(dist, name, recorded)


class TwoBranches(nn.Module):
    """f(x) + g(x), the branches built in a rank-dependent order: autograd runs the one built
    last first, so the gradients of f and g arrive in another order on each rank. g has no
    bias, so reductions ordered by arrival would differ in size, not only in content; each
    weight fills a DataParallel bucket of its own."""

    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(16, 16), nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 1, bias=False)

    def forward(self, x, f_first=True):
        branches = (self.f, self.g) if f_first else (self.g, self.f)
        outs = [torch.tanh(m(x)) for m in branches]
        return self.head(outs[0] + outs[1])


def _collective_sequence(rank, ws, wrapper, model_name):
    log = []
    _record_collectives(log)
    torch.manual_seed(0)
    if model_name == "branch order":
        model = TwoBranches()
        kwargs = {"f_first": rank == 0}
    else:
        model = Branchy()
        kwargs = _skips(wrapper, rank)
    wrapped, step, zero_grad = _wrap(wrapper, model)
    arrival = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrival.append(id(p)))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):  # the first backward, the one that agrees on an order, one more
        wrapped(torch.randn(4, 16 if model_name == "branch order" else 7, generator=g), **kwargs).sum().backward()
        step()
        zero_grad()
    return log, [index[i] for i in arrival]


@pytest.mark.parametrize("wrapper,model_name", [
    ("dp", "branch order"), ("zero1", "branch order"), ("zero2", "branch order"),
    ("dp", "unused"), ("zero1", "unused"), ("zero2", "unused"), ("zero3", "unused")])
def test_every_rank_issues_the_same_collectives(wrapper, model_name):
    (log0, arrival0), (log1, arrival1) = run_distributed(_collective_sequence, 2, args=(wrapper, model_name),
                                                         timeout_s=120, collective_timeout_s=30)
    assert arrival0 != arrival1  # the test's premise: gradients arrive differently on each rank
    assert any(op != "broadcast" for op, _, _ in log0)
    assert log0 == log1


def _zero3_without_prefetch(rank, ws):
    log = []
    _record_collectives(log)
    torch.manual_seed(0)
    model = Branchy()
    zero = ZeRO(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3, prefetch=False,
                wrap=lambda m: isinstance(m, (nn.Linear, Block)))
    for _ in range(2):
        zero(torch.randn(4, 7), **_skips("zero3", rank)).sum().backward()
        zero.step()
        zero.zero_grad()
    return log


def test_zero3_without_prefetch_interleaves_gathers_and_reductions_alike():
    # Without prefetch each backward all-gather sits between two reduce-scatters: a reduction
    # launched when a group's last gradient arrives (rank 0) rather than at the end of backward
    # (rank 1, where b's inner Linear got none) would cross an all-gather.
    log0, log1 = run_distributed(_zero3_without_prefetch, 2, timeout_s=120, collective_timeout_s=30)
    assert [op for op, _, _ in log0].count("reduce_scatter_single") == 2 * 5  # 5 groups (4 modules, root)
    assert log0 == log1


class GatedInput(nn.Module):
    """b's input requires grad only where `flag` routes it through the root's `gate`: whether
    a wrapped module's input requires grad depends on the data."""

    def __init__(self):
        super().__init__()
        self.a, self.d, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 1)
        self.gate = nn.Parameter(torch.ones(4))  # not in a wrapped module: the root group

    def forward(self, x, flag):
        h = self.d(torch.tanh(self.a(x)))
        return self.c(torch.tanh(self.b(x * self.gate if flag else x)) + h.sum(-1, keepdim=True))


def _gated_input(rank, ws, prefetch):
    log = []
    _record_collectives(log)
    torch.manual_seed(0)
    zero = ZeRO(GatedInput(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3, prefetch=prefetch,
                wrap=lambda m: isinstance(m, nn.Linear))
    for step in range(2):
        zero(torch.randn(3, 4), rank == step % 2).sum().backward()
        zero.step()
        zero.zero_grad()
    return log, [v.tolist() for v in zero.full_state_dict().values()]  # plain lists cross the process pipe


@pytest.mark.parametrize("prefetch", [False, True])
def test_zero3_input_requiring_grad_on_one_rank_only(prefetch):
    # Each module's reduce-scatter goes between the same two backward all-gathers on every
    # rank although b's input requires grad on one rank only (a review found reductions
    # deferred to the end on that rank: a hang on gloo, mixed collectives under NCCL).
    (log0, state0), (log1, state1) = run_distributed(_gated_input, 2, args=(prefetch,), timeout_s=120,
                                                     collective_timeout_s=30)
    assert log0 == log1
    assert [op for op, _, _ in log0].count("reduce_scatter_single") == 2 * 5  # 4 Linears + the root, 2 steps
    assert state0 == state1  # the replicas' parameters stay bitwise equal


def _whole_module_skipped(rank, ws):
    os.environ["PARALLEL_LAYERS_DEBUG"] = "1"
    torch.manual_seed(0)
    zero = ZeRO(Branchy(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3,
                wrap=lambda m: isinstance(m, (nn.Linear, Block)))
    try:
        zero(torch.randn(4, 7), skip_c=rank == 1).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_zero3_whole_module_skipped_is_an_error_on_every_rank():
    for message in run_distributed(_whole_module_skipped, 2, timeout_s=120, collective_timeout_s=30):
        assert message.startswith("PARALLEL_LAYERS_DEBUG: ranks disagree on the next collective"), message
        assert "rank 0: ZeRO all_gather of c" in message and "rank 1: ZeRO all_gather of d" in message


# ---- under the pipeline -----------------------------------------------------------------------
class Skippable(nn.Module):
    """A layer that takes one tensor and returns one; `skip` set per dp replica."""

    def __init__(self, width):
        super().__init__()
        self.lin, self.skip = nn.Linear(width, width), False

    def forward(self, h):
        return h if self.skip else torch.tanh(self.lin(h))


def _layers():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), Skippable(8), Skippable(8), nn.Linear(8, 2)]


def _pipeline(rank, world, wrapper):
    from parallel_layers import init_parallel
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    ctx = init_parallel(dp=2, pp=2)
    dp = ctx.coordinate("dp")
    layers = _layers()
    layers[2].skip = dp == 1  # on the second stage: dp replica 1 never uses its Linear
    stages = PipelineStages(layers, group=ctx.pp_group, split_points=[2])
    model, step, zero_grad = _wrap(wrapper, stages, group=ctx.dp_group)
    pipe = PipelineParallel(stages, schedule="1f1b", microbatches=2, loss_fn=F.mse_loss, data_parallel=model)

    ref_layers = _layers()
    ref = nn.Sequential(*ref_layers)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(2)]
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for replica, (x, y) in enumerate(batches):
            ref.zero_grad(set_to_none=True)
            ref_layers[2].skip = replica == 1
            F.mse_loss(ref(x), y).backward()
            for acc, p in zip(grads, ref.parameters()):
                if p.grad is not None:
                    acc += p.grad / 2
        for acc, p in zip(grads, ref.parameters()):
            p.grad = acc
        opt_ref.step()
        pipe.step(*batches[dp])
        step()
        zero_grad()
    mine = {id(p) for p in stages.parameters()}
    return max(_rel(p.detach(), q.detach()) for layer, ref_layer in zip(layers, ref_layers)
               for p, q in zip(layer.parameters(), ref_layer.parameters()) if id(p) in mine)


@pytest.mark.parametrize("wrapper", ["dp", "zero1"])
def test_pipeline_dp2_pp2_with_a_parameter_unused_on_one_replica(wrapper):
    errors = run_distributed(_pipeline, 4, args=(wrapper,), timeout_s=180, collective_timeout_s=30)
    assert max(errors) < RTOL, errors


class _RecordedGroup:
    """Stands in for a ZeRO ParamGroup: records its reductions, holds no parameter."""

    def __init__(self, name: str, world: int, log: list):
        self.name, self.world, self.log, self.params, self.keep_full = name, world, log, [], True
        self.pool = None  # no CPU buffer pool (Note [CPU buffer reuse])
        self.in_flight = False

    def reduce_grads(self, free_full_grads: bool, async_op: bool = False) -> None:
        self.log.append(self.name)  # launched (and, without async_op, done)
        self.in_flight = async_op

    def finish_reduce(self) -> None:
        if self.in_flight:
            self.log.append("~" + self.name)  # waited for
        self.in_flight = False


def test_zero_expert_groups_over_replicas_reduce_at_the_end_of_backward_in_one_order():
    """Note [expert groups]: the experts' groups over a replica group of several ranks are reduced
    at the end of backward, all of them in one order, whatever order (or whether) their gradients
    arrive in: mid-backward, a rank whose experts got no token would reduce later than its
    replicas, which then wait for it while its expert-parallel partners wait for them (a hang).
    Groups of this rank alone are reduced as soon as they are done; the dp group's order is
    apart, and launched before the experts' at the end, whose buffers are two in flight at most."""
    from parallel_layers.zero._hooks import ZeROHooks

    log = []
    dense, root = _RecordedGroup("layers.1", 2, log), _RecordedGroup("<root>", 2, log)
    experts = [_RecordedGroup(f"layers.{i}.experts", 2, log) for i in range(3)]
    alone = _RecordedGroup("solo.experts", 1, log)
    hooks = ZeROHooks(nn.Module(), [experts[0], dense, experts[1], experts[2], alone, root], {}, root, stage=2,
                      prefetch=False, reshard_after_forward=True, syncing=lambda: True,
                      experts=[experts[0], experts[1], experts[2], alone])
    hooks._backward_done(experts[1])
    hooks._backward_done(alone)
    hooks._backward_done(experts[2])
    hooks._backward_done(dense)
    assert log == ["solo.experts", "layers.1"]
    hooks._finalize_backward()  # layers.0's experts got no gradient here: reduced all the same
    # every dp group launched first; then the experts, two in flight at a time
    assert log == ["solo.experts", "layers.1", "<root>", "~layers.1", "layers.2.experts", "layers.1.experts",
                   "~layers.2.experts", "layers.0.experts", "~layers.1.experts", "~<root>", "~layers.0.experts"]
