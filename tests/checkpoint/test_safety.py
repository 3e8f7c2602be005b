"""Loading never runs pickled code and refuses what is not a checkpoint, with errors that name
the values: non-tensor objects, corrupt pieces, missing tensors, shape mismatches, wrong
directories, bad arguments. One process, no torch.distributed."""

import json
import os
import pathlib
import pickle

import pytest
import torch
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


def _replace_rank_file(path, obj):
    """Rewrite rank0.pt and fix its size in metadata.json, as a crafted checkpoint would."""
    torch.save(obj, os.path.join(path, "rank0.pt"))
    meta_path = os.path.join(path, "metadata.json")
    meta = json.load(open(meta_path))
    meta["files"]["rank0.pt"] = os.path.getsize(os.path.join(path, "rank0.pt"))
    json.dump(meta, open(meta_path, "w"))


def test_pickled_objects_are_refused(tmp_path):
    path, model = _saved(tmp_path / "ckpt")
    original = torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    marker = tmp_path / "code_ran"
    _replace_rank_file(path, {**original, "evil": Planted(str(marker))})
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True"):
        checkpoint.load(path, model)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True"):
        checkpoint.export_state_dict(path)
    assert not marker.exists()
    torch.load(os.path.join(path, "rank0.pt"), weights_only=False)  # the file really is malicious
    assert marker.exists()


def test_non_tensor_values_are_refused(tmp_path):
    path, model = _saved(tmp_path)
    original = torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    _replace_rank_file(path, {**original, "note": "hello", "count": 3})
    with pytest.raises(pickle.UnpicklingError, match=r"dict of str -> Tensor, found 'note': str, 'count': int"):
        checkpoint.load(path, model)


def test_corrupt_or_truncated_files_are_refused(tmp_path):
    path, model = _saved(tmp_path)
    original = torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    key = next(k for k in original if k.startswith("model/"))
    original[key] = original[key] + 1
    _replace_rank_file(path, original)
    with pytest.raises(ValueError, match=f"{key}.*CRC-32"):
        checkpoint.load(path, model)
    with open(os.path.join(path, "rank0.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="has 100 bytes.*truncated"):
        checkpoint.export_state_dict(path)


def test_model_mismatches_name_the_tensors(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(KeyError, match=r"no tensor for \['2.weight', '2.bias'\]"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"1.weight: checkpoint \(2, 4\) vs model \(5, 4\)"):
        checkpoint.load(path, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5)))
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
