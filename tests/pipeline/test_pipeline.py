"""PipelineParallel against the same model trained in one process: losses and parameters."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist_harness import run_distributed

STEPS = 3


def make_layers(n_layers=8, d=12, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, d)]
    layers += [nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n_layers - 2)]
    layers += [nn.Linear(d, 3)]
    return layers


def batches(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(STEPS)]


def reference(batch, lr=0.1):
    model = nn.Sequential(*make_layers())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(batch):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _pipeline_parity(rank, world, schedule, microbatches, virtual):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    layers = make_layers()
    stages = PipelineStages(layers, virtual=virtual)
    pipe = PipelineParallel(stages, schedule=schedule, microbatches=microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(stages.parameters(), lr=0.1)
    losses = []
    for x, y in batches(2 * microbatches):
        losses.append(pipe.step(x, y).item())
        opt.step()
        opt.zero_grad()
    ref_model, ref_losses = reference(2 * microbatches)
    ref_layers = list(ref_model)
    diff = 0.0
    for k in stages.stage_ids:
        start, end = stages.bounds[k]
        for mine, ref in zip(stages.chunk(k).parameters(), nn.Sequential(*ref_layers[start:end]).parameters()):
            diff = max(diff, (mine - ref).abs().max().item())
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), diff


# Every schedule at 2, 3 and 4 ranks with 1, p and 2p + 1 microbatches (all 27 take ~10 s: the
# ranks fork from the harness's preloaded forkserver).
CASES = [(s, p, m) for s in ("gpipe", "1f1b", "interleaved") for p in (2, 3, 4) for m in sorted({1, p, 2 * p + 1})]


@pytest.mark.parametrize("schedule,p,m", CASES)
def test_matches_single_process(schedule, p, m):
    virtual = 2 if schedule == "interleaved" else 1
    for loss_diff, param_diff in run_distributed(_pipeline_parity, p, args=(schedule, m, virtual)):
        assert loss_diff < 1e-6
        assert param_diff < 1e-6


def _ignored_targets(batch):
    """Targets with -100 (ignored) spread unevenly: microbatch 0 keeps one token, the rest all."""
    out = []
    for x, y in batches(batch):
        y = y.clone()
        y[1:batch // 2] = -100
        out.append((x, y))
    return out


def _token_normalised(rank, world, use_count):
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    stages = PipelineStages(make_layers())
    kwargs = dict(loss_fn=lambda out, t: F.cross_entropy(out, t, ignore_index=-100, reduction="sum"),
                  token_count=lambda t: (t != -100).sum()) if use_count else dict(loss_fn=F.cross_entropy)
    pipe = PipelineParallel(stages, schedule="1f1b", microbatches=2, **kwargs)
    opt = torch.optim.SGD(stages.parameters(), lr=0.1)
    losses = []
    for x, y in _ignored_targets(8):
        losses.append(pipe.step(x, y).item())
        opt.step()
        opt.zero_grad()
    model = nn.Sequential(*make_layers())  # one process, one batch: the mean over kept tokens
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for x, y in _ignored_targets(8):
        loss = F.cross_entropy(model(x), y, ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    return max(abs(a - b) for a, b in zip(losses, ref))


def test_loss_normalised_once_by_the_global_token_count():
    assert max(run_distributed(_token_normalised, 2, args=(True,))) < 1e-6
    # A mean per microbatch weighs microbatch 0's single token like 4 tokens: a different loss.
    assert min(run_distributed(_token_normalised, 2, args=(False,))) > 1e-2
