"""Mistakes in a pipelined step give a precise error on the ranks that can see them, not a hang."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist_harness import run_distributed


class ShrinksOnMicrobatch(nn.Module):
    """Drops a row of its output for the third microbatch of each step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)[:-1] if self.calls == 3 else self.lin(x)


class ReturnsTuple(nn.Linear):
    def forward(self, x):
        return super().forward(x), x


def _linear():
    return nn.Linear(4, 4)


def _returns_tuple():
    return ReturnsTuple(4, 4)


def _run(rank, world, first_layer, batch, microbatches, give_targets=True):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    torch.manual_seed(0)
    layers = [first_layer()] + [nn.Linear(4, 4) for _ in range(world - 2)] + [nn.Linear(4, 3)]
    pipe = PipelineParallel(PipelineStages(layers), schedule="gpipe", microbatches=microbatches,
                            loss_fn=F.cross_entropy)
    x, y = torch.randn(batch, 4), torch.randint(0, 3, (batch,))
    try:
        pipe.step(x if rank == 0 else None, y if rank == world - 1 and give_targets else None)
    except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: gloo saw its peer give up
        return str(e)
    return "no error"


def test_shape_change_between_microbatches_raises_on_every_rank():
    # Rank 2 never talks to stage 0's rank: the error reaches it with the step's loss all-reduce.
    expected = ("pipeline stage 0 produced (1, 4) torch.float32 for microbatch 2, but microbatch 0 of this step "
                "produced (2, 4) torch.float32")
    for message in run_distributed(_run, 3, args=(ShrinksOnMicrobatch, 8, 4), collective_timeout_s=20):
        assert message.startswith(expected)


def _targets_of_another_size(rank, world):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    torch.manual_seed(0)
    pipe = PipelineParallel(PipelineStages([nn.Linear(4, 4), nn.Linear(4, 3)]), microbatches=4,
                            loss_fn=F.cross_entropy)
    try:  # targets flattened from [4, 16] to 64 (review finding: the message said 4 % 4 = 0 was the problem)
        pipe.step(torch.randn(4, 4), torch.randint(0, 3, (64,)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_inputs_and_targets_of_other_sizes_raise_on_every_rank():
    msg = "the batch has 4 inputs and 64 targets (sizes on dim 0): a step's inputs and targets must be as many"
    assert run_distributed(_targets_of_another_size, 2) == [msg, msg]

class ShrinksInSecondStep(nn.Linear):
    """Drops a row of every output from its third call on: the second step, whose inputs have
    the first step's shape, so the boundary contract it sends against is the remembered one."""

    def __init__(self):
        super().__init__(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)[:-1] if self.calls > 2 else super().forward(x)


def _two_steps(rank, world):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    torch.manual_seed(0)
    pipe = PipelineParallel(PipelineStages([ShrinksInSecondStep(), nn.Linear(4, 3)]), schedule="1f1b",
                            microbatches=2, loss_fn=F.cross_entropy)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    first = pipe.step(x if rank == 0 else None, y if rank == 1 else None).item()
    try:
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
    except ValueError as e:
        return first, str(e)
    return first, "no error"


def test_a_remembered_contract_is_still_checked():
    expected = ("pipeline stage 0 produced (1, 4) torch.float32 for microbatch 0, but microbatch 0 of an earlier "
                "step with inputs of this shape produced (2, 4) torch.float32")
    for loss, message in run_distributed(_two_steps, 2, collective_timeout_s=20):
        assert loss > 0 and message.startswith(expected)


def test_batch_not_divisible_by_microbatches_raises_on_every_rank():
    msg = "the batch of 6 must divide into microbatches=4; 6 % 4 = 2; valid batch sizes are multiples of 4"
    assert run_distributed(_run, 2, args=(_linear, 6, 4)) == [msg, msg]


def test_missing_targets_raise_on_every_rank():
    msg = "pipeline step needs inputs on pipeline rank 0 (got 4) and targets on pipeline rank 1, the last stage's " \
          "(got none)"
    assert run_distributed(_run, 2, args=(_linear, 4, 2, False)) == [msg, msg]


def test_stage_returning_a_tuple_is_refused():
    refused, peer = run_distributed(_run, 2, args=(_returns_tuple, 4, 2), collective_timeout_s=10)
    assert refused.startswith("pipeline stage 0 returned tuple; a stage must return one tensor")
    # The next stage raises it too, at the step's end (Note [a failed stage]), instead of waiting.
    assert peer == f"pipeline rank 0 raised TypeError in the forward of stage 0, microbatch 0: {refused}"


class StageError(Exception):
    pass


class Raises(nn.Linear):
    """Raises in its forward, or (backward=True) in its backward, on the calls in `when`."""

    def __init__(self, when, backward=False):
        super().__init__(4, 4)
        self.when, self.backward, self.calls = set(when), backward, 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.when and not self.backward:
            raise StageError(f"call {self.calls} refused")
        y = super().forward(x)
        if self.calls in self.when:
            y = _RaisesInBackward.apply(y, self.calls)
        return y


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, call):
        ctx.call = call
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        raise StageError(f"the backward of call {ctx.call} refused")


def _failing_stage(rank, world, failing, when, backward, schedule, virtual):
    """Steps of a `world`-rank pipeline of linears whose stage `failing` raises on the calls in
    `when`; returns each step's loss or (exception type, message), and the gradients of a step
    run after the failures, for comparison with the plain model."""
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    torch.manual_seed(0)
    stages = world * virtual
    layers = [Raises(when, backward) if k == failing else nn.Linear(4, 4) for k in range(stages - 1)]
    layers.append(nn.Linear(4, 3))
    plain = nn.Sequential(*[nn.Linear(4, 4) for _ in range(stages - 1)], nn.Linear(4, 3))
    plain.load_state_dict(nn.Sequential(*layers).state_dict())
    pipeline_stages = PipelineStages(layers, virtual=virtual)
    pipe = PipelineParallel(pipeline_stages, schedule=schedule, microbatches=4, loss_fn=F.cross_entropy)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    results = []
    for _ in range(3):
        for p in pipeline_stages.parameters():
            p.grad = None
        try:
            results.append(pipe.step(x if rank == 0 else None, y if rank == world - 1 else None).item())
        except Exception as e:
            results.append((type(e).__name__, str(e)))
    F.cross_entropy(plain(x), y).backward()
    held = {id(p) for p in pipeline_stages.parameters()}
    worst = max((p.grad - q.grad).abs().max().item() for layer, ref in zip(layers, plain)
                for p, q in zip(layer.parameters(), ref.parameters()) if id(p) in held)
    return results, F.cross_entropy(plain(x), y).item(), worst


# (stage that fails, its calls that raise, in backward?, schedule, virtual stages per rank)
FAILURES = {
    # the first activation of the step: no contract yet, the boundary is dropped down the pipe
    "forward-first-microbatch": (1, {1}, False, "1f1b", 1),
    # a later microbatch of the first step: the contract is known, zeros go out
    "forward-later-microbatch": (1, {3}, False, "gpipe", 1),
    # the second step: the remembered contract
    "forward-second-step": (0, {5, 6}, False, "1f1b", 1),
    "backward": (1, {2}, True, "1f1b", 1),
    # stage 2 of 4 is pipeline rank 0's second chunk: its input arrives from rank 1
    "forward-interleaved": (2, {1}, False, "interleaved", 2),
}


@pytest.mark.parametrize("case", FAILURES)
def test_a_failing_stage_raises_on_every_rank_and_the_next_step_runs(case):
    failing, when, backward, schedule, virtual = FAILURES[case]
    world = 3 if virtual == 1 else 2
    results = run_distributed(_failing_stage, world, args=(failing, when, backward, schedule, virtual),
                              collective_timeout_s=20)
    rank = failing % world
    call = min(when)
    step = (call - 1) // 4
    where = "backward" if backward else "forward"
    mb = (call - 1) % 4 if not backward else None
    for r, (steps, plain_loss, worst) in enumerate(results):
        error = steps[step]
        if r == rank:
            assert error[0] == "StageError", (r, error)
            assert "refused" in error[1]
        else:
            assert error[0] == "RuntimeError", (r, error)
            assert error[1].startswith(f"pipeline rank {rank} raised StageError in the {where} of stage {failing}, "
                                       + (f"microbatch {mb}: " if mb is not None else "")), (r, error)
        for s, got in enumerate(steps):  # every other step runs, as the plain model does
            if s != step:
                assert isinstance(got, float) and abs(got - plain_loss) < 1e-5, (r, s, got, plain_loss)
        assert worst < 1e-5, (r, worst)  # the last step's gradients: nothing left over from the failure


def _too_many_dims(rank, world):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    class Unsendable(nn.Linear):
        def forward(self, x):
            return super().forward(x).reshape(x.shape[0], 1, 1, 1, 1, 1, 1, 1, 4)

    class Flatten(nn.Linear):
        def forward(self, x):
            return super().forward(x.reshape(x.shape[0], 4))

    pipe = PipelineParallel(PipelineStages([Unsendable(4, 4), Flatten(4, 4), nn.Linear(4, 3)]), schedule="1f1b",
                            microbatches=2, loss_fn=F.cross_entropy)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    try:
        pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_output_that_cannot_be_sent_raises_on_every_rank():
    # Rank 2 never receives from stage 0: the error reaches it at the step's end.
    assert run_distributed(_too_many_dims, 3, collective_timeout_s=20) == \
        ["a stage output has 9 dims; the pipeline sends at most 8"] * 3


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)])


def _replica_fails(rank, world, where):
    """pp2 x dp2: in step 2, replica 0's last stage raises in loss_fn or in token_count; every
    rank must raise, and the replicas stay equal (none stepped alone)."""
    import torch.distributed as dist

    from parallel_layers import init_parallel, parallelize

    ctx = init_parallel(dp=2, pp=2, device="cpu")
    torch.manual_seed(0)
    calls = {"loss": 0, "token_count": 0}

    def loss_fn(out, y):
        calls["loss"] += 1
        if where == "loss" and calls["loss"] == 3 and ctx.coordinate("dp") == 0:  # step 2, microbatch 0
            raise StageError("loss refused")
        return F.cross_entropy(out, y, reduction="sum")

    def token_count(y):
        calls["token_count"] += 1
        if where == "token_count" and calls["token_count"] == 3 and ctx.coordinate("dp") == 0:
            raise StageError("count refused")
        return y.numel()

    par = parallelize(_Net(), ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=loss_fn,
                      token_count=token_count, pipeline_layers="layers", microbatches=2)
    g = torch.Generator().manual_seed(ctx.coordinate("dp"))
    results = []
    for step in range(3):
        x, y = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
        if where == "batch" and step == 1 and ctx.coordinate("dp") == 0:  # 3 sequences for 2 microbatches
            x, y = x[:3], y[:3]
        try:
            results.append(par.forward_backward(x, y).item())
            par.step()
        except Exception as e:
            results.append((type(e).__name__, str(e)))
        par.zero_grad()
    checksum = torch.tensor([sum(p.double().sum().item() for p in par.module.parameters())])
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(sums, checksum.double(), group=ctx.dp_group)
    return ctx.coordinate("pp"), ctx.coordinate("dp"), results, [s.item() for s in sums]


@pytest.mark.parametrize("where", ["loss", "token_count", "batch"])
def test_a_failure_on_one_data_parallel_replica_raises_on_every_rank(where):
    message = "loss refused" if where == "loss" else "count refused"
    refused = "the batch of 3 must divide into microbatches=2; 3 % 2 = 1; valid batch sizes are multiples of 2"
    for pp, dp, results, sums in run_distributed(_replica_fails, 4, args=(where,), collective_timeout_s=20):
        assert isinstance(results[0], float) and isinstance(results[2], float), (pp, dp, results)
        kind, text = results[1]
        if where == "batch":  # refused before the step runs, on every rank of both replicas
            want = refused if dp == 0 else f"data-parallel replica 0's batch was refused: {refused}"
            assert (kind, text) == ("ValueError", want), (pp, dp, results[1])
        elif (pp, dp) == (1, 0):  # the last stage of replica 0 raised it
            assert (kind, text) == ("StageError", message)
        elif dp == 0:
            assert kind == "RuntimeError" and text.startswith("pipeline rank 1 raised StageError in ") and \
                text.endswith(message), (pp, dp, results[1])
        else:  # the other replica's pipeline ran fine, and raises too
            assert kind == "RuntimeError" and text.startswith("data-parallel replica 0's pipeline failed this step: "
                                                              "pipeline rank 1 raised StageError"), (pp, dp, results[1])
        assert sums[0] == sums[1], (pp, dp, sums)  # no replica took the failed step's update alone
