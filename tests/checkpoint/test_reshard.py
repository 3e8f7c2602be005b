"""Checkpoints move between layouts: tp=2 x dp=2 ZeRO-1 -> tp=1 x dp=4 ZeRO-3 -> one process
(and DataParallel), with the same model outputs; the optimizer state survives (continued
training matches the uninterrupted run, bitwise at the same layout); export_state_dict feeds
the plain model's load_state_dict(strict=True). Real gloo processes."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallel_layers import checkpoint
from tests.checkpoint._model import (
    EVAL_BATCH,
    TinyGPT,
    build,
    eval_losses,
    full_params,
    portable,
    rel_diff,
    tensors,
    train,
)
from tests.dist_harness import run_distributed

BEFORE, AFTER = 3, 2  # training steps before the save, and after it
# float32: another layout sums the same numbers in another order (TP all-reduce vs one GEMM,
# ZeRO reduce-scatter vs DP all-reduce); over 2 AdamW steps that stays ~1e-6 relative.
RTOL = 1e-5
A = dict(tp=2, dp=2, wrapper="zero1")


def _train_save_continue(rank, ws, root, layout):
    """Train BEFORE steps, save, then AFTER more: the uninterrupted run."""
    run = build(**layout, seed=0)
    train(run, 0, BEFORE)
    path = checkpoint.save(root, BEFORE, run.wrapped, run.optimizer, extra={"step": BEFORE, "epoch": 0})
    losses, draw = eval_losses(run), torch.rand(4)
    train(run, BEFORE, BEFORE + AFTER)
    return portable((path, losses, draw, full_params(run)))


def _load_continue(rank, ws, path, layout, save_root):
    """A fresh model (other seed) loads `path`, evaluates, optionally saves again, trains AFTER steps."""
    run = build(**layout, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = checkpoint.load(path, run.wrapped, run.optimizer)
    rng_skipped = any("RNG state not restored" in str(w.message) for w in caught)
    losses, draw = eval_losses(run), torch.rand(4)
    saved = checkpoint.save(save_root, extra["step"], run.wrapped, run.optimizer, extra=extra) if save_root else None
    train(run, extra["step"], extra["step"] + AFTER)
    return portable((saved, losses, draw, full_params(run), extra, rng_skipped))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("a")
    return tensors(run_distributed(_train_save_continue, 4, args=(str(root), A)))


def test_pieces_are_written_once(uninterrupted):
    """tp=2 x dp=2, ZeRO-1: ranks (dp, tp) = 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1). The step
    directory is a DCP checkpoint: every chunk is a box of the unparallelized tensor, stored
    once, and the chunks of a tensor cover it exactly."""
    path = uninterrupted[0][0]
    meta = dcp.FileSystemReader(path).read_metadata()
    owners = {}
    for index, info in meta.storage_data.items():  # files are __<rank>_<i>.distcp
        owners.setdefault(index.fqn, []).append(int(info.relative_path.split("_")[2]))
    ln = owners["model.layers.1.ln1.weight"]  # TP-replicated: one copy per ZeRO shard (dp rank)
    assert len(ln) == 2 and sorted(r // 2 for r in ln) == [0, 1], ln
    assert sorted(set(owners["model.layers.1.qkv.weight"])) == [0, 1, 2, 3]  # three fused blocks each
    assert sorted(set(owners["optimizer.state.layers.1.qkv.weight.exp_avg"])) == [0, 1, 2, 3]
    md = meta.state_dict_metadata
    assert tuple(md["model.layers.0.tokens.weight"].size) == (37, 10)  # vocab padding cropped
    assert tuple(md["model.layers.3.tokens.weight"].size) == (37, 10)  # the tied head: its own key, as in state_dict()
    step = {"state.layers.1.qkv.weight.step": torch.zeros(())}
    dcp.load({"optimizer": step}, checkpoint_id=path, no_dist=True)
    assert step["state.layers.1.qkv.weight.step"].item() == BEFORE
    for name, t in md.items():  # disjoint chunks that cover the tensor exactly
        if not isinstance(t, TensorStorageMetadata) or name.startswith("rng."):
            continue
        covered = torch.zeros(tuple(t.size))
        for chunk in t.chunks:
            region = covered
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, o, n)
            region += 1
        assert torch.equal(covered, torch.ones_like(covered)), name


def test_same_layout_resume_is_bitwise(uninterrupted):
    path = uninterrupted[0][0]
    resumed = tensors(run_distributed(_load_continue, 4, args=(path, A, None)))
    for rank, (want, got) in enumerate(zip(uninterrupted, resumed)):
        _, losses, draw, params, extra, rng_skipped = got
        assert extra == {"step": BEFORE, "epoch": 0}
        assert torch.equal(losses, want[1]), f"rank {rank}: outputs after load differ"
        assert not rng_skipped and torch.equal(draw, want[2]), f"rank {rank}: RNG state not restored"
        assert want[3].keys() == params.keys()
        for k in params:  # the same layout: the same operations on the same bits
            assert torch.equal(params[k], want[3][k]), f"rank {rank}: {k} differs after {AFTER} resumed steps"


@pytest.mark.parametrize("layout_b", [dict(tp=1, dp=4, wrapper="zero3"), dict(tp=2, dp=2, wrapper="ddp")],
                         ids=["tp1dp4-zero3", "tp2dp2-ddp"])
def test_reshard_round_trip(uninterrupted, tmp_path, layout_b):
    want_losses, want_params = uninterrupted[0][1], uninterrupted[0][3]
    # layout A -> layout B: same outputs; 2 more steps match the uninterrupted run.
    results = tensors(run_distributed(_load_continue, 4, args=(uninterrupted[0][0], layout_b, str(tmp_path))))
    path_b = results[0][0]
    for rank, (_, losses, _, params, extra, rng_skipped) in enumerate(results):
        assert rng_skipped == (rank == 0), "another layout: RNG left alone, rank 0 warns once"
        assert torch.allclose(losses, want_losses, rtol=RTOL, atol=1e-6), (rank, (losses - want_losses).abs().max())
        assert rel_diff(params, want_params) < RTOL, f"rank {rank}: continued training diverged after resharding"
    # layout B -> one process (no torch.distributed): same outputs and continued training.
    run = build(1, 1, "none", seed=2)
    with pytest.warns(RuntimeWarning, match="RNG state not restored"):
        assert checkpoint.load(path_b, run.model, run.optimizer) == {"step": BEFORE, "epoch": 0}
    single = eval_losses(run)
    assert torch.allclose(single, want_losses, rtol=RTOL, atol=1e-6), (single - want_losses).abs().max()
    # export -> the unparallelized model's own load_state_dict(strict=True).
    plain = TinyGPT()
    plain.load_state_dict(checkpoint.export_state_dict(path_b), strict=True)
    with torch.no_grad():
        assert torch.equal(plain(*EVAL_BATCH), single)
    train(run, BEFORE, BEFORE + AFTER)
    assert rel_diff(full_params(run), want_params) < RTOL
