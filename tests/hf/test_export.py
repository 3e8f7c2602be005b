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


def test_an_export_over_an_earlier_save_leaves_only_its_own_weight_files(tmp_path):
    """Note [stale weight files] (review finding): exported as one model.safetensors into a
    directory holding a sharded save, transformers removed the old shards but not their index,
    and hf.load_pretrained (which read the index first) failed on files no longer there. Both
    ways round, one process."""
    from parallel_layers import hf

    _tiny.save_tiny_llama(tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    model.save_pretrained(out, max_shard_size="20KB")  # an earlier, sharded save
    shards = sorted(p.name for p in out.iterdir() if p.name.startswith("model-"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists()
    hf.save_pretrained(model, str(out))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model")) == ["model.safetensors"]
    fresh = transformers.AutoModelForCausalLM.from_config(model.config)
    hf.load_pretrained(str(out), fresh)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    leftover = out / ".parallel_layers-export-files"  # what an export killed mid-way leaves (helper-44)
    leftover.mkdir()
    (leftover / "model.safetensors.index.json").write_text((out.parent / "src" / "config.json").read_text())
    hf.save_pretrained(model, str(out))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model")) == ["model.safetensors"]
    assert not leftover.exists()
    hf.save_pretrained(model, str(out), max_shard_size="20KB")  # and back to shards
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("model"))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and len(names) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [n for n in names if n.endswith(".safetensors")]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def _parallelized_everywhere(rank, world, source, root, out):
    from parallel_layers import checkpoint, hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    def build():
        ctx = init_parallel(pp=2, device="cpu")
        model = transformers.AutoModelForCausalLM.from_pretrained(source)
        return parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), loss_fn=causal_lm_loss,
                           pipeline_layers="auto")

    par = build()
    ids = torch.cat([_ids(5), _ids(7)])  # 4 rows: the default 4 microbatches
    par.forward_backward(ids, ids)
    par.step()
    path = checkpoint.save(root, 1, par)  # the Parallelized itself: its module, optimizer and prefix
    hf.save_pretrained(par, out)
    resumed = build()
    checkpoint.load(path, resumed)
    same = all(torch.equal(a, b) for a, b in zip(par.module.state_dict().values(), resumed.module.state_dict().values()))
    state = [s for p in resumed.optimizer.state.values() for s in p.values() if torch.is_tensor(s) and s.dim() > 0]
    return same, len(state), bool(state) and all(s.abs().sum() > 0 for s in state)


def test_checkpoint_and_export_take_the_parallelized(tmp_path):
    """checkpoint.save / load and hf.save_pretrained given the `Parallelized` of parallelize (at
    pp2, where its prefix matters) as hf.load_pretrained is: they raised AttributeError (review
    finding)."""
    _tiny.save_tiny_llama(tmp_path / "src")
    results = run_distributed(_parallelized_everywhere, 2,
                              args=(str(tmp_path / "src"), str(tmp_path / "ckpt"), str(tmp_path / "out")))
    for same, n_state, filled in results:
        assert same and n_state > 0 and filled  # the model and the AdamW moments came back
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    assert not torch.equal(exported.lm_head.weight, pretrained.lm_head.weight)  # the trained weights


def _config_after_export(rank, world, source, out):
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps), loss_fn=causal_lm_loss, zero_stage=3)
    before = model.config.to_dict()
    hf.save_pretrained(par, out, dtype=torch.float16)
    return before, model.config.to_dict(), str(model.config.dtype)


def test_an_export_leaves_the_models_config_alone(tmp_path):
    """helper-49: transformers' save wrote the export's dtype into the user's config, on rank 0
    only ('float16' there, torch.bfloat16 on rank 1): a model built from it afterwards (the
    resume recipe of docs/hf.md) had another dtype on rank 0, and the next collective failed on
    mismatched sizes."""
    _tiny.save_tiny_llama(tmp_path / "src")
    results = run_distributed(_config_after_export, 2, args=(str(tmp_path / "src"), str(tmp_path / "out")))
    for before, after, dtype in results:
        assert after == before and dtype == "torch.bfloat16", (dtype, {k: (before.get(k), v) for k, v in after.items()
                                                                       if before.get(k) != v})
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"  # the export's own
