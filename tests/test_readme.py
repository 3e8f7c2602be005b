"""README.md's quick start runs as written, and trains as plain transformers does.

The block is read out of README.md and run on 2 gloo processes with two lines changed: the
model directory (a tiny Llama saved here, nothing downloaded) and the layout (the README's
dp=2 x tp=2 x pp=2 needs 8 processes). Each layout's losses, exported parameters and export's
logits are compared with one process of plain transformers taking the same steps.
"""

import os
import pathlib

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BATCHES = dict(steps=3, batch=8, seq=16, vocab=128)


def _quick_start() -> str:
    text = README.read_text()
    section = text.split("## Quick start: a Hugging Face model", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _run_quick_start(rank, world, directory, workdir, layout):
    block = _quick_start()
    for old, new in (('path = "my-llama/"', f"path = {directory!r}"),
                     ("init_parallel(dp=2, tp=2, pp=2)", f"init_parallel({layout})")):
        assert block.count(old) == 1, f"README's quick start no longer has {old!r}"
        block = block.replace(old, new)
    os.chdir(workdir)  # the block writes ckpt/ and export/ where it runs
    scope, losses = {}, []

    def batches():  # the block's `batches`; each step's loss is read when the loop asks for the next
        for ids in _tiny.token_batches(**BATCHES):
            yield ids
            losses.append(scope["loss"].item())

    scope["batches"] = batches()
    exec(compile(block, str(README), "exec"), scope)
    return scope["ctx"].coordinate("dp"), losses, sorted(os.listdir("ckpt")), sorted(os.listdir("export"))


@pytest.mark.parametrize("layout", ["pp=2", "tp=2", "dp=2"])
def test_the_readme_quick_start_trains_as_plain_transformers(tmp_path, layout):
    _tiny.save_tiny_llama(tmp_path / "model")
    results = run_distributed(_run_quick_start, 2, args=(str(tmp_path / "model"), str(tmp_path), layout))
    initial = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-5)
    batches = _tiny.token_batches(**BATCHES)
    dp = 2 if layout == "dp=2" else 1
    expected = [[] for _ in range(dp)]  # each step's loss of each replica's rows
    for ids in batches:  # the whole batch's step, as the replicas' mean gradient makes it
        with torch.no_grad():
            for dp_rank, rows in enumerate(ids.chunk(dp)):
                expected[dp_rank].append(_tiny.next_token_loss(plain(rows), rows).item())
        _tiny.next_token_loss(plain(ids), ids).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for dp_rank, losses, ckpt, export in results:
        assert losses == pytest.approx(expected[dp_rank], abs=1e-5), (dp_rank, losses, expected[dp_rank])
        assert "latest" in ckpt and "model.safetensors" in export and "config.json" in export, (ckpt, export)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    start, want, got = (dict(m.named_parameters()) for m in (initial, plain, exported))
    assert got.keys() == want.keys()
    for name in want:  # the 3 steps' update, as plain transformers made it (AdamW's ~1e-5 a step)
        update, made = want[name] - start[name], got[name] - start[name]
        assert (made - update).norm() <= 1e-2 * update.norm(), (name, (made - update).norm(), update.norm())
    probe = _tiny.probe_ids(BATCHES["seq"], BATCHES["vocab"])
    with torch.no_grad():
        assert torch.allclose(exported(probe).logits, plain(probe).logits, atol=1e-5)
