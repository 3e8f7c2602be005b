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


def _lora(model, layers=None, head=False, saved=False, moe=False):
    torch.manual_seed(0)  # the adapters' initial values, the same in every process
    # head: the output head too, a column layer alone (its input gradient all-reduced by itself) that
    # gathers its output under tensor parallelism
    # (and the input embedding, which the published plan then keeps whole with its adapter);
    # saved: a trainable copy of the head (peft's modules_to_save), split as the head
    # moe: peft's "all-linear" on a Mixtral adapts its router and its stacked expert weights too (ParamWrapper)
    targets = "all-linear" if moe else ["q_proj", "v_proj", "down_proj"] + (["lm_head", "embed_tokens"] if head else [])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             modules_to_save=["lm_head"] if saved else None,
                             init_lora_weights=False,  # B != 0: the adapters change the output from step 1
                             layers_to_transform=layers)
    return peft.get_peft_model(model, config)


def _run(rank, world, directory, layout, out):
    from parallel_layers import checkpoint, hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    pp = 2 if layout.startswith("pp2") else 1
    tp = 2 if layout.startswith("tp2") else 1
    ctx = init_parallel(tp=tp, pp=pp, dp=world // (tp * pp), device="cpu")
    torch.manual_seed(rank)  # the ranks' own streams differ: the adapters' values must come from the model
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    later = "-later" in layout or layout.endswith("-after-a-step")
    if not later:
        model = _lora(model, head="-head" in layout, saved="-saved" in layout, moe=layout.endswith("-moe"))
    target = model.get_base_model() if layout == "pp2-base" else model
    try:
        par = parallelize(target, ctx, optimizer=lambda ps: _optimizer(ps, layout.endswith("-moe")),
                          loss_fn=causal_lm_loss,
                          tp_plan="auto" if tp > 1 else None, sequence_parallel="-sp" in layout,
                          zero_stage=3 if "zero3" in layout else 1 if "zero1" in layout else 0,
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


def _optimizer(params, moe=False):
    # a mixture's experts see few tokens each, and AdamW's normalised steps of their adapters' small
    # gradients carry float32's reduction-order differences to 1.1e-5 in 3 steps (its grouped_mm has
    # no float64): those layouts step SGD, which moves every adapter by lr times its gradient
    return torch.optim.SGD(params, lr=0.5) if moe else torch.optim.AdamW(params, lr=LR)


def _plain(directory, head=False, saved=False, moe=False):
    model = _lora(transformers.AutoModelForCausalLM.from_pretrained(directory), head=head, saved=saved, moe=moe)
    opt = _optimizer(model.parameters(), moe)
    return _tiny.plain_losses(model, opt, _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB)), model


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero3", "pp2-base", "tp2", "tp2-sp", "tp2-head", "tp2-saved",
                                    pytest.param("tp2-dp2-zero3", marks=pytest.mark.slow), "dp2-zero1-moe",
                                    "dp2-zero3-moe"])
def test_lora_trains_as_one_process_does(tmp_path, layout):
    """LoRA layers (q_proj, v_proj: column; down_proj: row) under tensor parallelism are split
    with their adapters (Note [LoRA under tensor parallelism] in tensor_parallel/lora.py). -moe:
    a Mixtral with LoRA on "all-linear", whose stacked expert weights peft adapts in place (its
    ParamWrapper; expert parallelism refuses those: test_expert_parallel.py)."""
    from parallel_layers import checkpoint

    (_tiny.save_tiny_mixtral if layout.endswith("-moe") else _tiny.save_tiny_llama)(tmp_path / "src")
    out = str(tmp_path / "out")
    world = 4 if layout == "tp2-dp2-zero3" else 2
    got = run_distributed(_run, world, args=(str(tmp_path / "src"), layout, out), timeout_s=300)
    want_losses, plain = _plain(tmp_path / "src", head="-head" in layout, saved="-saved" in layout,
                                moe=layout.endswith("-moe"))
    if layout.startswith("dp2"):  # each replica's loss is over its half of the batch; their mean is the plain one
        losses = [sum(pair) / 2 for pair in zip(got[0][0], got[1][0])]
    elif layout == "tp2-dp2-zero3":  # ranks 0 and 2 are the two replicas' first tp ranks
        losses = [sum(pair) / 2 for pair in zip(got[0][0], got[2][0])]
    elif layout.startswith("tp2"):  # every tp rank computes the whole batch's loss
        assert got[0][0] == got[1][0]
        losses = got[0][0]
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
    if layout.endswith("-moe"):  # the expert adapters trained (so the comparison above sees them)
        start = _lora(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src"), moe=True).state_dict()
        moved = {k: (want[k] - start[k]).abs().max().item() for k in want if "experts" in k and "lora_" in k}
        assert len(moved) == 8 and min(moved.values()) > 1e-4, moved  # 10x the tolerance above
    # pp2-base: the pipelined base model with adapters inside - refused before (its names are neither
    # the model's nor an adapter's), now written as peft writes the adapter (_peft.rewrapped)
    assert got[0][1] == "adapter" and got[1][1] == "adapter", got
    # the exported adapter on the base model from the files: the plain trained peft model's logits
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    loaded = peft.PeftModel.from_pretrained(base, out)
    ids = _tiny.probe_ids(SEQ, VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


def _added(count, first=None):
    return (f"refused: parallelize: {count} trainable parameter(s) were not in the model, or not of their shape "
            f"and dtype, when it was parallelized" + (f" (e.g. ['{first}'" if first else ""))


@pytest.mark.parametrize("layout", ["pp2", "dp2-later", "dp2-zero3-later", "pp2-later", "dp2-after-a-step"])
def test_what_would_train_wrongly_is_refused_on_every_rank(tmp_path, layout):
    _tiny.save_tiny_llama(tmp_path / "src")
    got = run_distributed(_run, 2, args=(str(tmp_path / "src"), layout, str(tmp_path / "out")))
    expected = {
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


def _on_meta(directory, **lora):
    with torch.device("meta"):  # the model and its adapters: nothing allocated
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
        return _lora(model) if not lora else peft.get_peft_model(model, peft.LoraConfig(
            r=4, **{"target_modules": ["q_proj", "v_proj"], **lora}))


def _meta_load_and_train(rank, world, directory, layout, out):
    from parallel_layers import checkpoint, hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    pp = 2 if layout.startswith("pp2") else 1
    tp = 2 if layout.startswith("tp2") else 1
    ctx = init_parallel(pp=pp, tp=tp, dp=world // (pp * tp), device="cpu")
    torch.manual_seed(rank)  # the ranks' own seeds differ: the adapters must not
    model = _on_meta(directory)
    target = model.get_base_model() if pp > 1 else model
    par = parallelize(target, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                      zero_stage={"dp2": 0, "dp2-zero1": 1, "dp2-zero3": 3, "pp2-base": 0, "tp2-sp": 0}[layout],
                      pipeline_layers="auto" if pp > 1 else None, tp_plan="auto" if tp > 1 else None,
                      sequence_parallel=layout == "tp2-sp")
    assert all(p.is_meta for p in par.module.parameters())  # the premise: nothing allocated yet
    hf.load_pretrained(directory, par, adapter_seed=SEED)
    losses = _tiny.parallel_losses(par, ctx, _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB))
    return losses, checkpoint.save(out, STEPS, par)


SEED = 5


def _loaded_on_one_process(directory, **lora):
    from parallel_layers import hf

    return hf.load_pretrained(directory, _on_meta(directory, **lora), device="cpu", adapter_seed=SEED)


@pytest.mark.parametrize("layout", ["dp2", "dp2-zero1", "dp2-zero3", "pp2-base", "tp2-sp"])
def test_adapters_built_on_meta_load_and_train_as_one_process_does(tmp_path, layout):
    """Note [adapters built on the meta device]: a model built on the meta device, adapted,
    parallelized and filled from its files trains as the unparallelized one loaded the same way,
    whose base is from_pretrained's (the reference for the adapters' values is that process:
    the same seed draws the same adapters at every layout, whatever each rank's own seed)."""
    from parallel_layers import checkpoint

    _tiny.save_tiny_llama(tmp_path / "src")
    out = str(tmp_path / "ckpt")
    got = run_distributed(_meta_load_and_train, 2, args=(str(tmp_path / "src"), layout, out))
    plain = _loaded_on_one_process(tmp_path / "src")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src").state_dict()
    for key, value in plain.state_dict().items():  # the base from the files, adapters drawn
        if "lora_" not in key:
            assert torch.equal(value, base[key.replace("base_model.model.", "").replace(".base_layer", "")]), key
    want_losses = _tiny.plain_losses(plain, torch.optim.AdamW(plain.parameters(), lr=LR),
                                     _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB))
    losses = [sum(pair) / 2 for pair in zip(got[0][0], got[1][0])] if layout.startswith("dp2") else got[1][0]
    if layout.startswith("tp2"):  # every tp rank: the whole batch's loss
        assert got[0][0] == got[1][0]
    assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
    trained = checkpoint.export_state_dict(got[0][1])
    want = plain.state_dict() if layout != "pp2-base" else plain.get_base_model().state_dict()
    assert sorted(trained) == sorted(want) and any("lora_B" in k for k in trained)
    for key, value in want.items():
        assert torch.allclose(trained[key], value, atol=1e-5), (key, (trained[key] - value).abs().max())
    if layout.endswith("-moe"):  # the expert adapters trained (so the comparison above sees them)
        start = _lora(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src"), moe=True).state_dict()
        moved = {k: (want[k] - start[k]).abs().max().item() for k in want if "experts" in k and "lora_" in k}
        assert len(moved) == 8 and min(moved.values()) > 1e-4, moved  # 10x the tolerance above


def test_adapters_drawn_on_meta_are_peft_initializations(tmp_path):
    _tiny.save_tiny_llama(tmp_path)
    hidden, r = transformers.AutoConfig.from_pretrained(tmp_path).hidden_size, 4
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.default.weight"
    for init in (True, "gaussian"):
        state = _loaded_on_one_process(tmp_path, init_lora_weights=init).state_dict()
        a, b = state[name.format("A")], state[name.format("B")]
        assert a.shape == (r, hidden) and torch.count_nonzero(b) == 0  # B = 0: the adapted model is the base model
        if init is True:  # kaiming-uniform(a=sqrt(5)) over the fan-in, as nn.Linear: U(-1/sqrt(hidden), ...)
            assert a.abs().max() <= hidden ** -0.5 and a.abs().max() > 0.8 * hidden ** -0.5
        else:  # N(0, 1/r)
            assert 0.7 / r < a.std() < 1.3 / r
    # an embedding's adapter (A = 0, B ~ N(0, 1)), and a trainable copy of the head: both from the files
    state = _loaded_on_one_process(tmp_path, target_modules=["embed_tokens"], modules_to_save=["lm_head"]).state_dict()
    files = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for copy in ("original_module", "modules_to_save.default"):
        assert torch.equal(state[f"base_model.model.lm_head.{copy}.weight"], files["lm_head.weight"]), copy
    embedding = "base_model.model.model.embed_tokens.lora_embedding_{}.default"
    assert torch.count_nonzero(state[embedding.format("A")]) == 0 and 0.7 < state[embedding.format("B")].std() < 1.3
    first, again = (_loaded_on_one_process(tmp_path, init_lora_weights=True).state_dict() for _ in range(2))
    assert torch.equal(again[name.format("A")], first[name.format("A")])  # one seed, one draw
    other = name.format("A").replace("layers.1", "layers.0")
    assert not torch.equal(first[other], first[name.format("A")])  # each layer its own


def _load_refused(rank, world, directory, lora):
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    par = parallelize(_on_meta(directory, **lora), ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
                      loss_fn=causal_lm_loss, zero_stage=3)
    try:
        hf.load_pretrained(directory, par)
    except ValueError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("lora", [{"init_lora_weights": "pissa"}, {"use_dora": True}], ids=["pissa", "dora"])
def test_adapters_computed_from_the_weights_are_refused_on_meta(tmp_path, lora):
    # before: every meta-built adapted model was refused; now what needs the base weights is
    _tiny.save_tiny_llama(tmp_path)
    expected = ("hf.load_pretrained: adapter 'default' has init_lora_weights='pissa', which peft computes from the "
                "base layer's weights" if "init_lora_weights" in lora else
                "hf.load_pretrained: adapter 'default' uses DoRA (use_dora=True), whose magnitude is the base weights' "
                "norms")
    for message in run_distributed(_load_refused, 2, args=(str(tmp_path), lora)):
        assert message.startswith(expected), message
        assert "then apply get_peft_model before parallelize" in message


def _tp_refused(rank, world, directory, kind):
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(tp=world, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    config = {"dora": peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
              "embedding": peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]),  # split by the plan below
              "ia3": peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
              "merge": peft.LoraConfig(r=4, target_modules=["q_proj"])}[kind]
    model = peft.get_peft_model(model, config)
    try:
        plan = "auto" if kind != "embedding" else {"model.embed_tokens": "vocab_parallel",
                                                     "model.layers.*.self_attn.q_proj": "column",
                                                     "model.layers.*.self_attn.o_proj": "row"}
        parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                    tp_plan=plan)
        if kind == "merge":
            model.merge_adapter()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize("kind", ["dora", "embedding", "ia3", "merge"])
def test_what_tensor_parallelism_does_not_split_is_refused_on_every_rank(tmp_path, kind):
    _tiny.save_tiny_llama(tmp_path)
    expected = {
        "dora": "parallelize: model.layers.0.self_attn.q_proj (Linear, adapted by peft) uses a LoRA variant (DoRA",
        "embedding": "parallelize: model.embed_tokens (Embedding, adapted by peft) adapts an embedding",
        "ia3": "parallelize: the plan splits model.layers.0.self_attn.q_proj, which is peft's Linear; tensor "
               "parallelism splits LoRA layers (and the modules peft left alone) only",
        # the adapter merged into a split base would be added to one shard of a whole-size delta
        "merge": "TensorParallelLinear: its base layer is split over the tensor-parallel group, and merging the "
                 "adapter into it is not supported",
    }[kind]
    for message in run_distributed(_tp_refused, 2, args=(str(tmp_path), kind)):
        assert message.startswith(expected), message


def _dropout_masks(rank, world, directory, sp):
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(tp=world, device="cpu")
    torch.manual_seed(rank)  # each rank's own stream differs: what the layer draws must not, for a column
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5))
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                      tp_plan="auto", sequence_parallel=sp)
    masks = {}

    def keep(short):
        def hook(module, args, out):  # returns None: the output stays
            masks.setdefault(short, out == 0)
        return hook

    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default") and ".layers.0." in name:
            module.register_forward_hook(keep(name.split(".")[-3]))
    ids = _tiny.token_batches(1, BATCH, SEQ, VOCAB)[0]
    par.forward_backward(ids, ids)
    return {name: mask.tolist() for name, mask in masks.items()}  # plain values through the result queue


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_lora_dropout_draws_where_the_input_lives(tmp_path, sp):
    """Note [LoRA under tensor parallelism]: a column's branch reads the replicated input, so its
    dropout mask is the same on every tp rank; a row's reads this rank's features, its own mask.
    helper-64: a region's later columns (k_proj, v_proj, up_proj) drew each rank's own mask."""
    _tiny.save_tiny_llama(tmp_path)
    masks = run_distributed(_dropout_masks, 2, args=(str(tmp_path), sp))
    columns, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    assert sorted(masks[0]) == sorted(columns + rows)
    masks = [{name: torch.tensor(mask) for name, mask in ranks.items()} for ranks in masks]
    for name in columns:
        assert torch.equal(masks[0][name], masks[1][name]), name
        assert 0.3 < masks[0][name].float().mean() < 0.7, name  # a dropout of 0.5 ran
    for name in rows:
        assert not torch.equal(masks[0][name], masks[1][name]), name


def _save_two_adapters_twice(rank, world, directory, out):
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    model = _lora(transformers.AutoModelForCausalLM.from_pretrained(directory))
    torch.manual_seed(1)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss)
    hf.save_pretrained(par, out)
    hf.save_pretrained(par, out)  # helper-64: the second save failed on peft's folder for "second"
    return {k: v.tolist() for k, v in model.state_dict().items() if "lora_" in k}


def test_an_adapter_export_with_two_adapters_can_be_written_again(tmp_path):
    _tiny.save_tiny_llama(tmp_path / "src")
    out = str(tmp_path / "out")
    state = run_distributed(_save_two_adapters_twice, 2, args=(str(tmp_path / "src"), out))[0]
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src"), out)
    loaded.load_adapter(str(tmp_path / "out" / "second"), adapter_name="second")
    got = loaded.state_dict()
    assert any(".second." in k for k in state) and any(".default." in k for k in state)
    for key, value in state.items():
        assert torch.equal(got[key], torch.tensor(value)), key


def test_adapted_layers_without_their_configs_are_not_exported(tmp_path):
    from parallel_layers import hf

    _tiny.save_tiny_llama(tmp_path / "src")
    base = _lora(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")).get_base_model()
    del base.peft_config  # peft's layers alone: their names are neither the model's nor an adapter's
    with pytest.raises(ValueError, match=r"hf.save_pretrained: LlamaForCausalLM holds 6 layer\(s\) adapted by peft, "
                                         r".* without peft's wrapper"):
        hf.save_pretrained(base, str(tmp_path / "out"))


def test_a_bad_adapter_seed_is_named(tmp_path):
    from parallel_layers import hf

    _tiny.save_tiny_llama(tmp_path)
    with pytest.raises(TypeError, match=r"adapter_seed must be an int .*; got '7'"):
        hf.load_pretrained(tmp_path, _on_meta(tmp_path), device="cpu", adapter_seed="7")
