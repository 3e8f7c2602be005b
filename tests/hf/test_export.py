"""hf.save_pretrained from any layout writes a directory that plain
`transformers.AutoModelForCausalLM.from_pretrained` loads with the parallel model's logits and
weights: a Llama (grouped-query attention, untied head) at tp=2 and tp=2 x dp=2 with ZeRO-3,
a GPT-2 (Conv1D weights stored [in, out], tied head) at tp=2 (those two with activation
checkpointing), and a Mixtral (experts stacked
in the model, each split as its MLP, one tensor per expert in the files) at tp=2 x dp=2 with
ZeRO-3, each after a training step. Real gloo processes."""

import json

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")

CASES = {"llama-tp2": ("llama", 2, 1, 0), "llama-tp2dp2-zero3": ("llama", 2, 2, 3), "gpt2-tp2": ("gpt2", 2, 1, 0),
         "mixtral-tp2dp2-zero3": ("mixtral", 2, 2, 3)}


def _ids(seed):
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def _train_and_export(rank, world, source, target, tp, dp, stage):
    from parallel_layers import ZeRO, hf, init_parallel
    from parallel_layers.activation_checkpointing import checkpoint_blocks
    from parallel_layers.tensor_parallel import parallelize

    ctx = init_parallel(tp=tp, dp=dp, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    parallelize(model, tp_group=ctx.tp_group)
    if not stage:  # trained with activation checkpointing, which the exported config must not show
        checkpoint_blocks(model, "full", lambda m: type(m).__name__.endswith(("DecoderLayer", "Block")))
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    if stage:
        wrapped = opt = ZeRO(model, adamw, stage=stage, group=ctx.dp_group,
                             wrap=lambda m: type(m).__name__.endswith(("DecoderLayer", "Block")))
    else:
        wrapped, opt = model, adamw(model.parameters())
    ids = _ids(5).chunk(dp)[ctx.coordinate("dp")]
    wrapped(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        logits = wrapped(input_ids=_ids(6)).logits
    if ctx.tp_group is not None and tp > 1 and logits.shape[-1] != model.config.vocab_size:  # a sharded head
        raise AssertionError("the published plans gather the head's output")
    hf.save_pretrained(wrapped, target)
    return logits.tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_plain_transformers(tmp_path, case):
    family, tp, dp, stage = CASES[case]
    getattr(_tiny, f"save_tiny_{family}")(tmp_path / "src")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "src")  # the model's sampling settings
    generation.update(do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=17)
    generation.save_pretrained(tmp_path / "src")
    results = run_distributed(_train_and_export, tp * dp, args=(str(tmp_path / "src"), str(tmp_path / "out"), tp,
                                                                dp, stage), timeout_s=240)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    with torch.no_grad():
        got = exported(input_ids=_ids(6)).logits
        before = pretrained(input_ids=_ids(6)).logits
    for logits in results:
        # float32; the parallel model sums its row layers in another order: ~1e-7 relative.
        assert torch.allclose(got, torch.tensor(logits), rtol=1e-5, atol=1e-5), (got - torch.tensor(logits)).abs().max()
    assert not torch.allclose(got, before, atol=1e-3)  # the trained weights, not the pretrained ones
    assert not any(f.startswith(".parallel_layers") for f in (p.name for p in (tmp_path / "out").iterdir()))
    # the configs transformers itself writes for the model (review finding: the export made its
    # generation config from the model config, dropping the sampling settings, and wrote the
    # use_cache=False of activation checkpointing)
    pretrained.save_pretrained(tmp_path / "plain")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads((tmp_path / "plain" / name).read_text())
    if family == "mixtral":  # written as transformers writes it: one tensor per expert
        from safetensors import safe_open
        with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
            assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in f.keys()
