"""Note [a random stream per pipeline stage] with the pipeline's own API: a checkpoint restores
the stage stream whether it is loaded before or after PipelineParallel is built, and the user's
stream is left as it was (GPT-2 cases: tests/tensor_parallel/test_region_random.py)."""

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.dist_harness import run_distributed


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.lin(x)))


def _build():
    from parallel_layers.pipeline import PipelineStages

    torch.manual_seed(0)
    stages = PipelineStages(nn.ModuleList([_Block() for _ in range(4)]), group=dist.group.WORLD)
    return stages, torch.optim.SGD(stages.parameters(), lr=0.1)


def _pipe(stages):
    from parallel_layers.pipeline import PipelineParallel

    return PipelineParallel(stages, microbatches=2, loss_fn=lambda y, t: ((y - t) ** 2).mean())


def _step(pipe, opt):
    opt.zero_grad()
    x = torch.randn(4, 16)  # the user's stream: the same batch on every pipeline rank
    loss = pipe.step(x, x).item()
    opt.step()
    return loss


def _run(rank, ws, directory, order):
    from parallel_layers import checkpoint

    stages, opt = _build()
    if order == "uninterrupted":
        pipe = _pipe(stages)
        _step(pipe, opt)
        checkpoint.save(directory, 1, stages, opt)
    elif order == "load, then the pipeline":  # the stage stream is seeded after the load: it keeps it
        checkpoint.load(f"{directory}/step_1", stages, opt)
        pipe = _pipe(stages)
    else:
        pipe = _pipe(stages)
        checkpoint.load(f"{directory}/step_1", stages, opt)
    return [_step(pipe, opt), _step(pipe, opt)]


def test_a_checkpoint_restores_the_stage_stream_whenever_it_is_loaded(tmp_path):
    """Review finding: a PipelineParallel built after checkpoint.load reseeded the stage (and
    region) streams the load had restored, and the resumed run drew other dropout masks."""
    after = run_distributed(_run, 2, args=(str(tmp_path), "uninterrupted"), timeout_s=240)
    assert after[0] == after[1] and after[0][0] != after[0][1]
    for order in ("the pipeline, then load", "load, then the pipeline"):
        assert run_distributed(_run, 2, args=(str(tmp_path), order), timeout_s=240) == after, order


def _stale(rank, ws, directory, case):
    from parallel_layers import checkpoint, random_states

    stages, opt = _build()
    if case == "save":  # step 1: a checkpoint with the stage stream; step 2: one without (an older version's)
        pipe = _pipe(stages)
        _step(pipe, opt)
        checkpoint.save(f"{directory}/full", 1, stages, opt)
        _step(pipe, opt)
        get, put = random_states._streams["pp_stage"]
        random_states._streams["pp_stage"] = (lambda: {}, put)
        checkpoint.save(f"{directory}/old", 2, stages, opt)
        random_states._streams["pp_stage"] = (get, put)
        return None
    if case in ("old", "full, then old"):
        if case == "full, then old":
            checkpoint.load(f"{directory}/full/step_1", stages, opt)
        checkpoint.load(f"{directory}/old/step_2", stages, opt)
    elif case == "load A, then a new model B":
        checkpoint.load(f"{directory}/full/step_1", stages, opt)
        _pipe(stages)  # A's pipeline, never stepped
        stages, opt = _build()  # B, from the same seed as a fresh run
    pipe = _pipe(stages)
    return [_step(pipe, opt), _step(pipe, opt)]


def test_a_restored_stage_stream_is_kept_only_for_the_pipeline_of_its_load(tmp_path):
    """Review findings: a second load whose checkpoint holds no stage stream kept the first
    load's, and a new model's pipeline built after a load drew from the loaded stream rather
    than its own seed. The restored states are kept only while the default generator is the
    one that load restored."""
    run_distributed(_stale, 2, args=(str(tmp_path), "save"), timeout_s=240)
    runs = {case: run_distributed(_stale, 2, args=(str(tmp_path), case), timeout_s=240)
            for case in ("old", "full, then old", "fresh", "load A, then a new model B")}
    assert runs["full, then old"] == runs["old"]
    assert runs["load A, then a new model B"] == runs["fresh"] != runs["old"]


def _tp_after_the_pipeline(rank, ws):
    from parallel_layers import init_parallel
    from parallel_layers.pipeline import PipelineParallel, PipelineStages, stage_random
    from parallel_layers.tensor_parallel import Column, parallelize
    from parallel_layers.tensor_parallel import region_random

    ctx = init_parallel(pp=2, tp=2, device="cpu")
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block() for _ in range(4)])
    torch.manual_seed(10 + rank)  # each rank its own stream, as many scripts seed
    stages = PipelineStages(blocks, group=ctx.pp_group)
    pipe = PipelineParallel(stages, microbatches=2, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    # then TP, the other way round from parallelize's order: the group shares one stream only now
    parallelize(stages, {"*.lin": Column(gather_output=True)}, ctx.tp_group)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss = pipe.step(x, x).item()
    return ctx.coordinate("pp"), stage_random._stream.seed, region_random._streams.seed, loss


def test_tensor_parallelism_after_the_pipeline_seeds_the_stage_stream_from_the_shared_state():
    """Built before TP, the stage stream was seeded from each rank's own state: the two TP ranks
    of one stage drew different residual-dropout masks over the same replicated values (their
    losses differed). TP now seeds it again once its group shares one stream."""
    runs = run_distributed(_tp_after_the_pipeline, 4, timeout_s=240)
    by_stage = {pp: {seed for p, seed, _, _ in runs if p == pp} for pp in (0, 1)}
    assert all(len(seeds) == 1 for seeds in by_stage.values()) and by_stage[0] != by_stage[1], runs
    assert len({region for _, _, region, _ in runs}) == 4, runs  # every rank its own region stream
    assert len({loss for *_, loss in runs}) == 1, runs
