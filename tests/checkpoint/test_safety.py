"""Loading never runs pickled code and refuses what is not a checkpoint, with errors that name
the values: planted objects, corrupt or truncated files (and latest_checkpoint falls back past
them), missing tensors, shape mismatches, wrong directories, bad arguments. One process, no
torch.distributed."""

import os
import pathlib
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn

from parallel_layers import checkpoint


class Planted:
    """Unpickling this creates a file: proof that arbitrary code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _saved(tmp_path, model=None):
    model = model or nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return checkpoint.save(str(tmp_path), 1, model, opt), model


def _dcp_file(path):
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files, os.listdir(path)
    return os.path.join(path, files[0])


def test_pickled_objects_are_refused(tmp_path):
    """DCP's own reader unpickles .metadata and optimizer settings freely; ours does not."""
    marker = tmp_path / "code_ran"
    # 1. A planted object in .metadata.
    path, model = _saved(tmp_path / "ckpt")
    meta_path = os.path.join(path, ".metadata")
    meta = pickle.load(open(meta_path, "rb"))
    meta.storage_meta.modules = [Planted(str(marker))]
    pickle.dump(meta, open(meta_path, "wb"))
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle pathlib.Path.touch"):
        checkpoint.load(path, model)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle pathlib.Path.touch"):
        checkpoint.export_state_dict(path)
    assert not marker.exists()
    pickle.load(open(meta_path, "rb"))  # the file really is malicious
    assert marker.exists()
    marker.unlink()
    # 2. A planted object as an optimizer setting (a value DCP stores with torch.save).
    model = nn.Linear(3, 4)
    planted = str(tmp_path / "planted")
    os.makedirs(planted)
    dcp.save({"model": model.state_dict(), "optimizer": {"param_groups.weight.lr": Planted(str(marker))}},
             checkpoint_id=planted, no_dist=True)
    with pytest.raises(CheckpointException, match="refusing to load 'optimizer.param_groups.weight.lr'.*weights_only"):
        checkpoint.load(planted, model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert not marker.exists()


def test_non_tensor_values_are_plain_values(tmp_path):
    """Optimizer settings come back as the numbers and tuples they were."""
    path, model = _saved(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.1, 0.2))
    checkpoint.load(path, model, opt)
    assert opt.param_groups[0]["lr"] == 0.001 and opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_corrupt_or_truncated_files_are_refused(tmp_path):
    root = tmp_path / "ckpt"
    first, model = _saved(root)
    opt = torch.optim.AdamW(model.parameters())
    path = checkpoint.save(str(root), 2, model, opt)
    assert checkpoint.latest_checkpoint(str(root)) == path
    target = _dcp_file(path)
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    open(target, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=f"{os.path.basename(target)} does not match the CRC-32"):
        checkpoint.verify(path)
    with pytest.warns(RuntimeWarning, match="step_2 is corrupt.*falling back"):
        assert checkpoint.latest_checkpoint(str(root)) == first  # never the corrupt one
    with open(target, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="has 100 bytes"):
        checkpoint.load(path, model)
    with pytest.warns(RuntimeWarning, match="step_2 is corrupt"):
        assert checkpoint.latest_checkpoint(str(root)) == first


def test_model_mismatches_name_the_tensors(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(KeyError, match=r"no tensor for \['2.weight', '2.bias'\]"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"1.weight: checkpoint \(2, 4\) vs model \(5, 4\)"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5)))
    # the transpose: what an earlier version saved of a GPT-2 Conv1D weight at tp > 1 (review finding)
    with pytest.raises(ValueError, match=r"1.weight: checkpoint \(2, 4\) vs model \(4, 2\) \(its transpose: "
                                         r"parallel_layers before 2026-11-27 saved a GPT-2 Conv1D weight \[out, in\]"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4), nn.Linear(2, 4, bias=False)), strict=False)
    with pytest.raises(KeyError, match=r"holds \['1.weight', '1.bias'\], which no rank's model has"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4)))
    checkpoint.load(path, nn.Sequential(nn.Linear(3, 4)), strict=False, restore_rng=False)
    with pytest.raises(ValueError, match="saved without optimizer state"):
        bare = checkpoint.save(str(tmp_path / "bare"), 0, nn.Linear(3, 4))
        lin = nn.Linear(3, 4)
        checkpoint.load(bare, lin, torch.optim.SGD(lin.parameters(), lr=1))
    other = nn.Linear(3, 4)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        checkpoint.save(str(tmp_path), 2, nn.Linear(3, 4), torch.optim.SGD(other.parameters(), lr=1))


def test_bad_paths_and_arguments(tmp_path):
    path, model = _saved(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'.*step_7' does not exist.*\['step_1'\]"):
        checkpoint.load(str(tmp_path / "step_7"), model)
    with pytest.raises(FileNotFoundError, match=r"not a complete checkpoint.*\['step_1'\]"):
        checkpoint.load(str(tmp_path), model)  # the root, not a checkpoint in it
    with pytest.raises(TypeError, match="extra must hold only JSON values"):
        checkpoint.save(str(tmp_path), 2, model, extra={"loader": object()})
    with pytest.raises(ValueError, match="step must be a non-negative int, got -1"):
        checkpoint.save(str(tmp_path), -1, model)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1"]  # refused saves leave nothing behind


def test_an_untied_checkpoint_into_a_tied_model_is_refused(tmp_path):
    """Note [ties in a checkpoint] (review finding): the untied model's embedding and head both
    went into the tied model's one tensor, the last written winning, with no error."""
    transformers = pytest.importorskip("transformers")

    def llama(tied: bool):
        torch.manual_seed(0 if tied else 1)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=32, tie_word_embeddings=tied))

    untied, tied = checkpoint.save(str(tmp_path / "untied"), 1, llama(False)), \
        checkpoint.save(str(tmp_path / "tied"), 1, llama(True))
    with pytest.raises(ValueError, match=re.escape(
            "holds model.embed_tokens.weight and ['lm_head.weight'] as separate tensors (the model that saved it did "
            "not tie them), but this model ties them")):
        checkpoint.load(untied, llama(True))
    model = llama(False)  # the other way: both keys take the one saved value, as from_pretrained unties
    checkpoint.load(tied, model)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    checkpoint.load(tied, llama(True))


def _adamw_steps(model, opt, sched, steps):
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_a_tensor_learning_rate_is_saved_at_the_call_and_loads_back(tmp_path):
    """Review finding (helper-55): a Tensor lr (torch's advice for compiled optimizers) went into
    the checkpoint by reference, so async_save wrote the value a scheduler set later, and load
    failed in DCP's planning ("expected BytesStorageMetadata but found TensorStorageMetadata")."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    _adamw_steps(model, opt, sched, 2)
    at_save = opt.param_groups[0]["lr"].item()
    handle = checkpoint.async_save(str(tmp_path), 2, model, opt)
    _adamw_steps(model, opt, sched, 2)  # the scheduler fills the same tensor meanwhile
    path = handle.result()
    resumed = nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=torch.tensor(0.5))
    checkpoint.load(path, resumed, opt2)
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == at_save == pytest.approx(0.0025)  # a float32 tensor


def test_a_failed_async_save_is_raised_once(tmp_path, monkeypatch):
    """Review finding (helper-55): after handle.result() raised a failed commit, the next save
    (or a recovery load) raised that same error again."""
    from parallel_layers.checkpoint import _io

    commit, calls = _io.commit, []

    def fails_once(partial, ours):
        calls.append(partial)
        if len(calls) == 1:
            raise OSError("No space left on device")
        return commit(partial, ours)

    monkeypatch.setattr(_io, "commit", fails_once)
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="No space left on device"):
        checkpoint.async_save(str(tmp_path), 1, model).result()
    assert checkpoint.save(str(tmp_path), 2, model) == str(tmp_path / "step_2")


def test_another_optimizers_state_names_the_mismatch(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = checkpoint.save(str(tmp_path), 1, model, opt)
    with pytest.raises(ValueError, match=r"AdamW could not take the checkpoint's optimizer state \(per parameter: "
                                         r"\['momentum_buffer'\]\): KeyError: 'step'. Was it saved with another"):
        checkpoint.load(path, model, torch.optim.AdamW(model.parameters()))
