"""Pipeline stages contribute disjoint names: a checkpoint saved at pp=2 x tp=2 (the embedding
tied to the head across the two stages) loads into the one-process model, whose continued
training matches the one-process run that never stopped."""

import pytest
import torch

from parallel_layers import checkpoint, init_parallel
from parallel_layers.pipeline import PipelineParallel, PipelineStages
from tests.checkpoint._model import TinyGPT, batch, build, full_params, make_optimizer, rel_diff, token_losses, train
from tests.dist_harness import run_distributed

BEFORE, AFTER = 2, 2
RTOL = 1e-5  # float32 reduction order (TP all-reduces, microbatch accumulation) over AdamW steps


def _pipeline_save(rank, ws, root):
    ctx = init_parallel(tp=2, pp=2, dp=1, device="cpu")
    torch.manual_seed(0)
    model = TinyGPT(ctx.tp_group)
    stages = PipelineStages(model.layers, group=ctx.pp_group)
    head = model.layers[-1]
    pipe = PipelineParallel(stages, microbatches=2,
                            loss_fn=lambda logits, t: token_losses(logits, t, head.tokens).mean())
    opt = make_optimizer(stages.parameters())
    for step in range(BEFORE):
        pipe.step(*batch(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    path = checkpoint.save(root, BEFORE, stages, opt, extra={"step": BEFORE}, prefix="layers.")
    return path


def test_pipeline_checkpoint_loads_in_one_process(tmp_path):
    path = run_distributed(_pipeline_save, 4, args=(str(tmp_path),))[0]
    ref = build(1, 1, "none", seed=0)  # the same training in one process, uninterrupted
    train(ref, 0, BEFORE + AFTER)
    run = build(1, 1, "none", seed=3)
    with pytest.warns(RuntimeWarning, match="RNG state not restored"):  # saved by 4 ranks
        assert checkpoint.load(path, run.model, run.optimizer) == {"step": BEFORE}
    train(run, BEFORE, BEFORE + AFTER)
    assert rel_diff(full_params(run), full_params(ref)) < RTOL
    TinyGPT().load_state_dict(checkpoint.export_state_dict(path), strict=True)
