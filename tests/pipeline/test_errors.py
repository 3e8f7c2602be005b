"""Mistakes in a pipelined step give a precise error on the ranks that can see them, not a hang."""

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
    msg = ("the batch (6 inputs, 6 targets) must have equal sizes divisible by microbatches=4; 6 % 4 = 2; "
           "valid batch sizes are multiples of 4")
    assert run_distributed(_run, 2, args=(_linear, 6, 4)) == [msg, msg]


def test_missing_targets_raise_on_every_rank():
    msg = "pipeline step needs inputs on pipeline rank 0 (got 4) and targets on pipeline rank 1, the last stage's " \
          "(got none)"
    assert run_distributed(_run, 2, args=(_linear, 4, 2, False)) == [msg, msg]


def test_stage_returning_a_tuple_is_refused():
    refused, peer = run_distributed(_run, 2, args=(_returns_tuple, 4, 2), collective_timeout_s=10)
    assert refused.startswith("pipeline stage 0 returned tuple; a stage must return one tensor")
    assert peer != "no error"  # the next stage fails too (its peer closed), instead of waiting
