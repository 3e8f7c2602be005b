"""A save that dies half-way leaves the previous checkpoint intact and in charge: the dead
save's directory is ignored by latest_checkpoint and refused by load, and the next save
removes it. The crash is real: a rank calls os._exit at a chosen point (DataParallel, dp=2)."""

import os

import pytest
import torch

from parallel_layers import checkpoint
from parallel_layers.checkpoint import _io
from tests.checkpoint._model import TinyGPT, build, full_params, portable, rel_diff, tensors, train
from tests.dist_harness import DistributedTestFailure, run_distributed


def _die(*args, **kwargs):
    os._exit(17)


def _save_twice_and_crash(rank, ws, root, crash_rank, point):
    run = build(1, 2, "ddp", seed=0)
    train(run, 0, 1)
    checkpoint.save(root, 1, run.wrapped, run.optimizer, extra={"step": 1})
    state_at_1 = full_params(run)
    train(run, 1, 2)
    if rank == crash_rank and point == "after_own_file":  # file written, peers not yet told
        record = _io.record_written
        _io.record_written = lambda *a: (record(*a), _die())
    if rank == crash_rank and point == "before_rename":  # every file and parallel_layers.json written
        rename = os.rename  # DCP renames its .metadata into place first: let that one through
        os.rename = lambda src, dst: _die() if ".partial-" in os.path.basename(src) else rename(src, dst)
    if rank == crash_rank and point == "before_latest":  # renamed to step_2, `latest` not updated
        os.replace = _die
    checkpoint.save(root, 2, run.wrapped, run.optimizer, extra={"step": 2})
    return portable(state_at_1)


@pytest.mark.parametrize("crash_rank, point", [(1, "after_own_file"), (0, "before_rename"), (0, "before_latest")])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, crash_rank, point):
    root = str(tmp_path)
    with pytest.raises(DistributedTestFailure, match=f"rank {crash_rank} of 2 exited with code 17"):
        run_distributed(_save_twice_and_crash, 2, args=(root, crash_rank, point))
    entries = sorted(os.listdir(root))
    step1 = os.path.join(root, "step_1")
    if point == "before_latest":  # the new checkpoint is complete; `latest` still names step 1
        assert [e for e in entries if e != ".latest.tmp"] == ["latest", "step_1", "step_2"]
        assert checkpoint.latest_checkpoint(root) == step1
        assert checkpoint.export_state_dict(os.path.join(root, "step_2")).keys() == TinyGPT().state_dict().keys()
        return
    partial = [e for e in entries if ".partial-" in e]
    assert len(partial) == 1 and entries == sorted(["latest", partial[0], "step_1"]), entries
    assert os.path.exists(os.path.join(root, partial[0], _io.OURS)) == (point == "before_rename")
    assert checkpoint.latest_checkpoint(root) == step1
    with pytest.raises(FileNotFoundError, match="unfinished save"):
        checkpoint.load(os.path.join(root, partial[0]), TinyGPT())

    # The previous checkpoint loads in full (in this process: no torch.distributed).
    run = build(1, 1, "none", seed=5)
    with pytest.warns(RuntimeWarning, match="RNG state not restored"):  # saved by 2 ranks
        assert checkpoint.load(step1, run.model, run.optimizer) == {"step": 1}
    saved = tensors(run_distributed(_state_at_step_1, 2, args=()))[0]
    assert rel_diff(full_params(run), saved) == 0.0
    # The next save clears the dead one away.
    checkpoint.save(root, 2, run.model, run.optimizer)
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2"]
    assert checkpoint.latest_checkpoint(root) == os.path.join(root, "step_2")


def _state_at_step_1(rank, ws):
    run = build(1, 2, "ddp", seed=0)
    train(run, 0, 1)
    return portable(full_params(run))


def test_incomplete_directories_are_never_checkpoints(tmp_path):
    run = build(1, 1, "none", seed=0)
    checkpoint.save(str(tmp_path), 1, run.model)
    os.makedirs(tmp_path / "step_9")  # a step directory without .metadata (e.g. copied half-way)
    torch.save({}, tmp_path / "step_9" / "__0_0.distcp")
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_1")
    (tmp_path / "latest").write_text("step_9\n")  # `latest` naming an incomplete one is not trusted
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_1")
    with pytest.raises(FileNotFoundError, match=r"not a complete checkpoint.*\['step_1'\]"):
        checkpoint.load(str(tmp_path / "step_9"), run.model)
    assert checkpoint.latest_checkpoint(str(tmp_path / "nothing_here")) is None
