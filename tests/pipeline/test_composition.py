"""Pipeline stages with tensor-parallel layers inside and DataParallel / ZeRO over the dp axis,
against the same GPT trained in one process; tied embedding / head across stages; clipping."""

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_distributed

STEPS = 3
CFG = dict(vocab=64, seq_len=16, d_model=32, heads=4, layers=2)


def _data(batch):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG["vocab"], (STEPS, batch, CFG["seq_len"] + 1), generator=g)
    return ids[..., :-1], ids[..., 1:]


def _single_process(batch, clip=None):
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    ids, targets = _data(batch)
    for step in range(STEPS):
        loss = model.loss(model(ids[step]), targets[step])
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def _gpt_pipeline(rank, world, tp, pp, dp, schedule, microbatches, wrapper, clip):
    from parallel_layers import DataParallel, ZeRO, init_parallel, tensor_parallel
    from parallel_layers.models import GPT, GPT_TP_PLAN, Block, GPTConfig
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    ctx = init_parallel(tp=tp, pp=pp, dp=dp)
    torch.manual_seed(0)
    model = tensor_parallel.parallelize(GPT(GPTConfig(**CFG)), GPT_TP_PLAN, ctx.tp_group)
    stages = PipelineStages(model.layers, group=ctx.pp_group, virtual=2 if schedule == "interleaved" else 1)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapper == "ddp":
            dp_model, opt = DataParallel(stages, group=ctx.dp_group), make_opt(stages.parameters())
            step, zero_grad = opt.step, lambda: opt.zero_grad(set_to_none=True)
        elif wrapper.startswith("zero"):
            dp_model = ZeRO(stages, make_opt, stage=int(wrapper[-1]), group=ctx.dp_group,
                            wrap=lambda m: isinstance(m, Block))
            step, zero_grad = dp_model.step, dp_model.zero_grad
        pipe = PipelineParallel(stages, schedule=schedule, microbatches=microbatches, loss_fn=model.loss,
                                data_parallel=dp_model)
    warned = [str(w.message) for w in caught if "pipeline" in str(w.message)]
    per_replica = 2 * microbatches
    batch = per_replica * dp
    ids, targets = _data(batch)
    rows = slice(ctx.coordinate("dp") * per_replica, (ctx.coordinate("dp") + 1) * per_replica)
    losses, norms = [], []
    for i in range(STEPS):
        loss = pipe.step(ids[i][rows], targets[i][rows])
        if clip is not None:
            norms.append(pipe.clip_grad_norm_(clip, tp_group=ctx.tp_group).item())
        step()
        zero_grad()
        dist.all_reduce(loss, group=ctx.dp_group)
        losses.append(loss.item() / dp)
    ref_losses, ref_norms, _ = _single_process(batch, clip)
    return max(abs(a - b) / b for a, b in zip(losses, ref_losses)), norms, ref_norms, warned


def _check(results, clip=None):
    for loss_diff, norms, ref_norms, _ in results:
        assert loss_diff < 2e-5, results
        if clip is not None:
            assert ref_norms[0] > clip  # so clipping is exercised
            assert norms == pytest.approx(ref_norms, rel=1e-4)


def test_dp2_tp2_pp2_gpt_matches_single_process():
    # 8 processes: TP inside the stages, ZeRO-1 over dp (the default with PP), tied embedding/head
    # on stages 0 and 1, global-norm clipping over pp, tp and the dp shards.
    results = run_distributed(_gpt_pipeline, 8, args=(2, 2, 2, "1f1b", 2, "zero1", 0.5), timeout_s=300)
    _check(results, clip=0.5)


@pytest.mark.parametrize("schedule,microbatches,wrapper", [
    ("gpipe", 3, "ddp"), ("interleaved", 2, "ddp"), ("1f1b", 2, "zero2"), ("1f1b", 3, "zero3")])
def test_dp2_pp2(schedule, microbatches, wrapper):
    results = run_distributed(_gpt_pipeline, 4, args=(1, 2, 2, schedule, microbatches, wrapper, 0.5),
                              timeout_s=240)
    _check(results, clip=0.5)
    warned = results[0][3]
    assert bool(warned) == (wrapper in ("zero2", "zero3")), warned


def test_tp2_pp2_interleaved_without_data_parallel():
    results = run_distributed(_gpt_pipeline, 4, args=(2, 2, 1, "interleaved", 3, "ddp", None), timeout_s=240)
    _check(results)
