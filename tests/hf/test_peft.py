"""LoRA fine-tuning with peft (Note [peft models] in parallel_layers/_peft.py), against the same
peft model trained in one process (review finding, helper-47): data parallelism (DataParallel,
ZeRO-3) and a pipeline over the base model train it as plain peft does, and hf.save_pretrained
writes its adapter, as peft's own save does; what would have trained wrongly without a word is
refused on every rank - tensor parallelism (the published plan matched none of the wrapper's
names: nothing was split), the pipeline's "auto" cut of the wrapper, adapters added after
parallelize (nothing stepped them), the adapted layers exported or loaded as a plain model."""

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, BATCH, SEQ, VOCAB, LR = 3, 4, 16, 128, 1e-2


def _lora(model, layers=None):
    torch.manual_seed(0)  # the adapters' initial values, the same in every process
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                             init_lora_weights=False,  # B != 0: the adapters change the output from step 1
                             layers_to_transform=layers)
    return peft.get_peft_model(model, config)


def _run(rank, world, directory, layout, out):
    from parallel_layers import checkpoint, hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    pp = 2 if layout.startswith("pp2") else 1
    tp = 2 if layout.startswith("tp2") else 1
    ctx = init_parallel(tp=tp, pp=pp, dp=world // (tp * pp), device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    later = "-later" in layout or layout.endswith("-after-a-step")
    if not later:
        model = _lora(model)
    target = model.get_base_model() if layout == "pp2-base" else model
    try:
        par = parallelize(target, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                          tp_plan="auto" if tp > 1 else None, sequence_parallel=layout.endswith("-sp"),
                          zero_stage=3 if "zero3" in layout else 0,
                          pipeline_layers="auto" if pp > 1 else None)
        batches = _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB)
        if layout.endswith("-after-a-step"):
            _tiny.parallel_losses(par, ctx, batches[:1])
        if later:  # pp2: layer 1's adapters only, which pipeline rank 1's stage holds
            model = _lora(model, layers=[1] if pp > 1 else None)
        losses = _tiny.parallel_losses(par, ctx, batches)
    except (ValueError, RuntimeError) as e:
        return f"refused: {e}"
    path = checkpoint.save(out + "-ckpt", STEPS, par)
    try:
        hf.save_pretrained(par, out)
        exported = "adapter"
    except ValueError as e:
        exported = f"refused: {e}"
    return losses, exported, path


def _plain(directory):
    model = _lora(transformers.AutoModelForCausalLM.from_pretrained(directory))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return _tiny.plain_losses(model, opt, _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB)), model


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero3", "pp2-base"])
def test_lora_trains_as_one_process_does(tmp_path, layout):
    from parallel_layers import checkpoint

    _tiny.save_tiny_llama(tmp_path / "src")
    out = str(tmp_path / "out")
    got = run_distributed(_run, 2, args=(str(tmp_path / "src"), layout, out))
    want_losses, plain = _plain(tmp_path / "src")
    if layout.startswith("dp2"):  # each replica's loss is over its half of the batch; their mean is the plain one
        losses = [sum(pair) / 2 for pair in zip(got[0][0], got[1][0])]
    else:  # the pipeline's last stage returns the loss
        losses = got[1][0]
    assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
    # every tensor, the trained adapters and the frozen base, as plain peft's after 3 steps
    trained = checkpoint.export_state_dict(got[0][2])
    want = plain.state_dict() if layout != "pp2-base" else plain.get_base_model().state_dict()
    assert sorted(trained) == sorted(want)
    assert any("lora_A" in k for k in trained)
    for key, value in want.items():
        assert torch.allclose(trained[key], value, atol=1e-5), (key, (trained[key] - value).abs().max())
    if layout == "pp2-base":  # the base model with adapters inside: neither the model's names nor an adapter's
        assert got[0][1].startswith("refused: hf.save_pretrained: LlamaForCausalLM holds"), got[0][1]
        assert "Pass the PeftModel that get_peft_model returned" in got[0][1]
        return
    assert got[0][1] == "adapter"
    # the exported adapter on the base model from the files: the plain trained peft model's logits
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    loaded = peft.PeftModel.from_pretrained(base, out)
    ids = _tiny.probe_ids(SEQ, VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


def _added(count, first=None):
    return (f"refused: parallelize: {count} trainable parameter(s) were not in the model, or not of their shape "
            f"and dtype, when it was parallelized" + (f" (e.g. ['{first}'" if first else ""))


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "dp2-later", "dp2-zero3-later", "pp2-later",
                                    "dp2-after-a-step"])
def test_what_would_train_wrongly_is_refused_on_every_rank(tmp_path, layout):
    _tiny.save_tiny_llama(tmp_path / "src")
    got = run_distributed(_run, 2, args=(str(tmp_path / "src"), layout, str(tmp_path / "out")))
    expected = {
        # before: the published plan matched none of the wrapper's names, and every rank trained the whole model
        "tp2": "refused: parallelize: tensor parallelism does not split peft's adapted layers, and PeftModel holds 6 "
               "layer(s) adapted by peft, e.g. base_model.model.model.layers.0.self_attn.q_proj "
               "(peft.tuners.lora.layer.Linear). Train a peft model with data parallelism",
        "tp2-sp": "refused: parallelize: tensor parallelism does not split peft's adapted layers",
        # before: an AttributeError from inside the cut
        "pp2": "refused: pipeline_layers='auto' needs a transformers model's own modules; PeftModel is "
               "peft's wrapper around a LlamaForCausalLM: pass its base model, parallelize(peft_model.get_base_model()",
        # before: the adapters were in no optimizer, bucket or unit, and nothing trained
        "dp2-later": _added(12, "model.layers.0.self_attn.q_proj.lora_A.default.weight"),
        "dp2-zero3-later": _added(12),
        # helper-50: raised by pipeline rank 1 alone (its stage holds layer 1), rank 0 then waited
        "pp2-later": _added(6, "model.layers.1.self_attn.q_proj.lora_A.default.weight"),
        # helper-50: checked at the first step only, which had passed
        "dp2-after-a-step": _added(12),
    }[layout]
    for rank, result in enumerate(got):
        assert isinstance(result, str) and result.startswith(expected), (rank, result)


def _load_into_adapted(rank, world, directory):
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    with torch.device("meta"):
        model = _lora(transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory)))
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                      zero_stage=3)
    try:
        hf.load_pretrained(directory, par)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_loading_weight_files_into_an_adapted_model_is_refused(tmp_path):
    _tiny.save_tiny_llama(tmp_path)
    for message in run_distributed(_load_into_adapted, 2, args=(str(tmp_path),)):
        assert message.startswith("hf.load_pretrained fills a transformers model's tensors from its weight files; "
                                  "ZeRO holds 6 layer(s) adapted by peft"), message
        assert "apply get_peft_model before parallelize" in message
