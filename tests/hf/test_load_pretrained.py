"""hf.load_pretrained: a model built on the meta device, parallelized at a layout, then filled from
a Hugging Face directory, against plain `transformers.AutoModelForCausalLM.from_pretrained` of
the same directory: logits, and losses and logits after 3 AdamW steps.

Layouts (real gloo processes): Llama at tp=2 through the TP-only `tensor_parallel.parallelize`
from a sharded `model.safetensors.index.json` (first, one rank's error raised on both ranks);
through the composing `parallelize`: Llama at tp=2 x dp=2 with ZeRO-3, GPT-2 (Conv1D weights
stored [in, out], head tied) at tp=2 x dp=2 with ZeRO-1 (master shards that are views of the full
parameters), Qwen2 at dp=2 with DataParallel, Qwen3 (per-head q / k norms whose gradients
are summed over tp) and an untied Gemma (its embedding, which scales the rows in its own forward,
vocabulary-parallel) at tp=2 x dp=2 with ZeRO-3; cut into pipeline stages (pipeline_layers='auto'):
a Llama with a tied head and Mistral at pp=2, the tied Llama and an untied one at pp=2 x tp=2,
every stage's pieces checked against the files and every parameter after the steps. In one process: every family (Llama, Qwen2,
Mistral, GPT-2) unparallelized, so the rotary buffers no file holds are checked per family; the
errors."""

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

STEPS, BATCH, SEQ, VOCAB = 3, 4, 12, 96  # VOCAB: ids valid for every tiny family
# (family, tp, dp, zero_stage, API, sharded files)
CASES = {"llama-tp2-index": ("llama", 2, 1, None, "tensor_parallel", True),
         "llama-tp2-dp2-zero3": ("llama", 2, 2, 3, "parallelize", False),
         "gpt2-tp2-dp2-zero1": ("gpt2", 2, 2, 1, "parallelize", False),
         # the head is the embedding's weight: one parameter, in ZeRO's root group (Note [vocabulary units])
         "llama-tied-dp2-zero3": ("llama-tied", 1, 2, 3, "parallelize", False),
         "qwen2-dp2-dataparallel": ("qwen2", 1, 2, 0, "parallelize", False),
         # q_norm / k_norm: replicated, gradients summed over tp (its published plan), under ZeRO-3
         "qwen3-tp2-dp2-zero3": ("qwen3", 2, 2, 3, "parallelize", False),
         # its embedding scales the rows in its own forward (an nn.Embedding subclass), vocabulary-parallel
         "gemma-untied-tp2-dp2-zero3": ("gemma-untied", 2, 2, 3, "parallelize", False),
         # experts one tensor per expert in the files, stacked in the model (Note [experts stacked at
         # load]), each split as its MLP over tp (tensor_parallel/experts.py); ZeRO-3's flat pieces cut
         # them anywhere
         "mixtral-tp2-dp2-zero3": ("mixtral", 2, 2, 3, "parallelize", False),
         "qwen3_moe-tp2-index": ("qwen3_moe", 2, 1, None, "tensor_parallel", True),
         # each rank whole experts (Note [whole experts per rank]): boxes cut on the expert dim
         "qwen3_moe-whole-experts-tp2-index": ("qwen3_moe-whole-experts", 2, 1, None, "tensor_parallel", True)}


def _batches():
    return _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB)


def _probe():
    return _tiny.probe_ids(SEQ, VOCAB)


_loss = _tiny.next_token_loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _save(family, directory, sharded=False):
    if family == "llama-tied":  # the head is the input embedding's weight
        _tiny.save_tiny_llama(directory, tie_word_embeddings=True)
    elif family == "gemma-untied":
        _tiny.save_tiny_gemma(directory, tie_word_embeddings=False)
    elif family == "qwen3_moe-whole-experts":
        _tiny.save_tiny_qwen3_moe(directory)
    else:
        getattr(_tiny, f"save_tiny_{family}")(directory)
    if sharded:  # the same weights cut into several files under model.safetensors.index.json
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        os.remove(os.path.join(directory, "model.safetensors"))
        model.save_pretrained(directory, max_shard_size="20KB")
        assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) > 2


def _on_meta(directory):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


def _meta_load_and_train(rank, world, directory, tp, dp, stage, api, family=None):
    from parallel_layers import hf, init_parallel, parallelize, tensor_parallel

    ctx = init_parallel(tp=tp, dp=dp, device="cpu")
    model = _on_meta(directory)
    if api == "tensor_parallel":
        plan = tensor_parallel.published_plan(model)
        if family == "qwen3_moe-whole-experts":
            plan["model.layers.*.mlp.experts"] = tensor_parallel.Experts(split="experts")
        tensor_parallel.parallelize(model, plan, tp_group=ctx.tp_group)  # the published plan
        if family == "qwen3_moe-whole-experts":  # 2 of the 4 experts on each rank
            assert model.model.layers[0].mlp.experts.gate_up_proj.tp_shard.dim == 0
            assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2
        one_bad_rank = _load_with_one_bad_rank(rank, model, directory)
        # built on the meta parameters, as parallelize() does: they keep their identity
        target, opt = model, _adamw(model.parameters())
    else:  # ZeRO's default units (Note [vocabulary units] in parallelize.py)
        target = parallelize(model, ctx, optimizer=_adamw, loss_fn=_loss, tp_plan="auto" if tp > 1 else None,
                             zero_stage=stage)
    assert any(p.is_meta for p in model.parameters())  # the premise: nothing allocated yet
    hf.load_pretrained(directory, target, device=None if api == "parallelize" else "cpu")  # ctx.device
    net = target.module if api == "parallelize" else model
    with torch.no_grad():
        logits = [net(_probe()).logits.tolist()]
    losses = []
    for ids in _batches():
        mine = ids.chunk(dp)[ctx.coordinate("dp")]  # equal token counts: the mean of means is the batch mean
        if api == "parallelize":
            loss = target.forward_backward(mine, mine)
            target.step()
            target.zero_grad()
        else:
            loss = _loss(net(mine), mine)
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    with torch.no_grad():
        logits.append(net(_probe()).logits.tolist())
    vocab_parallel = isinstance(model.get_input_embeddings(), tensor_parallel.VocabParallelEmbedding)
    units = None
    if api == "parallelize" and stage:  # ZeRO's groups: name -> its parameters' names
        names = {id(p): n for n, p in target.module.module.named_parameters()}
        units = {g.name: sorted(names[id(p)] for p in g.params) for g in target.module.groups}
        if stage == 3:  # what stays gathered between uses: the root's parameters alone
            root = target.module.root_group
            units["held bytes"] = [target.module.memory_bytes()["params"],
                                   sum(p.numel() * p.element_size() for p in root.params) if root else 0]
    return logits, losses, one_bad_rank if api == "tensor_parallel" else None, vocab_parallel, units


def _reference(directory):
    """The plain model's logits (before, after) and losses of the 3 steps, and the trained model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = [model(_probe()).logits]
    opt, losses = _adamw(model.parameters()), []
    for ids in _batches():
        loss = _loss(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits.append(model(_probe()).logits)
    return logits, losses, model


@pytest.mark.parametrize("case", list(CASES))
def test_meta_built_model_loads_and_trains_like_from_pretrained(tmp_path, case):
    family, tp, dp, stage, api, sharded = CASES[case]
    _save(family, tmp_path, sharded)
    (tmp_path / "no-weights").mkdir()
    (ref_before, ref_after), ref_losses, _ = _reference(tmp_path)
    results = run_distributed(_meta_load_and_train, tp * dp, args=(str(tmp_path), tp, dp, stage, api, family),
                              timeout_s=240)
    for (before, after), losses, _, vocab_parallel, units in results:
        # the published plans of Llama and Qwen2 split an untied embedding on the vocabulary
        assert vocab_parallel == (tp > 1 and family != "gpt2")
        if units is not None:  # the decoder layers, and an untied embedding and head, each a unit
            head = "lm_head.weight"
            embedding = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
            held, root_bytes = units.pop("held bytes", (None, None))
            embedding_bytes = VOCAB * 32 * 4 / tp  # a table of at least VOCAB rows of hidden 32, float32
            if held is not None:  # ZeRO-3: an untied embedding and head are not held between steps
                assert held == root_bytes and (held >= embedding_bytes) == (family == "llama-tied"), (held, units)
            layers = sorted(n for n in units if n.rpartition(".")[2].isdigit())
            assert len(layers) == 2 and all(n.endswith(("layers.0", "layers.1", "h.0", "h.1")) for n in layers), units
            if family in ("gpt2", "llama-tied"):
                assert set(units) == {*layers, "<root>"} and embedding in units["<root>"], units
                assert head not in units["<root>"]  # the same parameter, registered once
            else:
                assert units["lm_head"] == [head] and embedding in units[embedding.rpartition(".")[0]], units
                assert not {head, embedding} & set(units.get("<root>", [])), units
        # float32; the parallel model sums its row layers and the dp halves in another order
        # (~1e-7 relative), which AdamW's normalisation amplifies over 3 steps to ~1e-6.
        assert torch.allclose(torch.tensor(before), ref_before, rtol=1e-4, atol=1e-4)
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        assert torch.allclose(torch.tensor(after), ref_after, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref_after, ref_before, atol=1e-2)  # the steps moved the weights
    if api == "tensor_parallel":  # rank 1 was given a directory without safetensors: both raised
        errors = [r[2] for r in results]
        assert errors[1].startswith("FileNotFoundError") and "neither model.safetensors" in errors[1], errors[1]
        assert errors[0].startswith("RuntimeError: hf.load_pretrained failed on 1 rank(s): rank 1: "
                                    "FileNotFoundError"), errors[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", "mixtral", "qwen3_moe"])
def test_every_family_loads_unparallelized_from_meta(tmp_path, family):
    """One process, no torch.distributed: the rotary buffers (`inv_freq`, not in the files; Mistral's
    rope_theta is not the default) come from the model's constructor. GPT-NeoX's files name its
    head `embed_out`, the model `lm_head` (Note [checkpoint key renamings]). Mixtral's and
    Qwen3-MoE's files hold one tensor per expert, the model one stack (Note [experts stacked at
    load])."""
    from safetensors import safe_open

    from parallel_layers import hf

    _save(family, tmp_path)
    if family == "gpt_neox":
        with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
            assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = hf.load_pretrained(tmp_path, _on_meta(tmp_path), device="cpu")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    for name, buf in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    with torch.no_grad():
        assert torch.equal(model(_probe()).logits, reference(_probe()).logits)
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_with_a_heads_files_load_into_its_base_model(tmp_path, family):
    """transformers' from_pretrained reads a LlamaForCausalLM's files ("model.embed_tokens.weight")
    into a LlamaModel (prefix "model", no head) and GPT-2's ("transformer.wte.weight") into
    GPT2Model; hf.load_pretrained named every tensor missing (review finding, helper-55)."""
    from parallel_layers import hf

    _save(family, tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    reference = transformers.AutoModel.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    hf.load_pretrained(tmp_path, model, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(_probe()).last_hidden_state, reference(_probe()).last_hidden_state)


def test_errors_name_the_values(tmp_path):
    from safetensors.torch import load_file, save_file

    from parallel_layers import hf

    _save("llama", tmp_path / "llama")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json.*"
                                                r"config\.json"):
        hf.load_pretrained(tmp_path / "empty", _on_meta(tmp_path / "llama"))

    # a tensor missing from the file
    state = load_file(tmp_path / "llama" / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "llama" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"no tensor for \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        hf.load_pretrained(tmp_path / "llama", _on_meta(tmp_path / "llama"), device="cpu")

    # per-expert tensors that do not stack (Note [experts stacked at load]): expert 3's w1 is missing
    _save("mixtral", tmp_path / "mixtral")
    state = load_file(tmp_path / "mixtral" / "model.safetensors")
    del state["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    save_file(state, tmp_path / "mixtral" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"no tensor for \['model\.layers\.0\.mlp\.experts\.gate_up_proj'\] \(1 "
                                       r"missing\).*the per-expert tensors of "
                                       r"model\.layers\.0\.mlp\.experts\.gate_up_proj do not stack: the files hold "
                                       r"'\.experts\.\*\.w1\.weight' for experts \[0, 1, 2\], not for \[3\]\W*$"):
        hf.load_pretrained(tmp_path / "mixtral", _on_meta(tmp_path / "mixtral"), device="cpu")

    # a model whose shapes differ from the file's
    _save("llama", tmp_path / "llama")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama")
    config.intermediate_size = 48
    with torch.device("meta"):
        other = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: \(64, 32\) in "
                                         r"model\.safetensors, the model's model\.layers\.0\.mlp\.gate_proj\.weight "
                                         r"expects \(48, 32\)"):
        hf.load_pretrained(tmp_path / "llama", other, device="cpu")


def _train_before_loading(rank, world, directory, zero_stage=3):
    from parallel_layers import init_parallel, meta, parallelize

    ctx = init_parallel(dp=world, device="cpu")
    block = lambda m: type(m).__name__.endswith("DecoderLayer")  # noqa: E731
    model = _on_meta(directory)
    par = parallelize(model, ctx, optimizer=_adamw, loss_fn=_loss, zero_stage=zero_stage, wrap=block)
    if not zero_stage:  # the model given storage, not the DataParallel around it: its buckets stay on meta
        meta.materialize(model, "cpu")
    try:
        par.forward_backward(_probe(), _probe())
    except RuntimeError as e:
        return str(e)
    return None


def test_training_a_meta_built_model_before_loading_it_names_the_fix(tmp_path):
    # Forgetting hf.load_pretrained: torch's own errors would name the meta device deep in a
    # layer ("Tensor.item() cannot be called on meta tensors"); the first step names the fix.
    _save("llama", tmp_path)
    # helper-51: DataParallel of a model materialized alone failed "Cannot copy out of meta tensor"
    for message in [*run_distributed(_train_before_loading, 2, args=(str(tmp_path),)),
                    *run_distributed(_train_before_loading, 2, args=(str(tmp_path), 0))]:
        assert message is not None and message.startswith(
            "parallelize: the model still has tensors on the meta device") and \
            "hf.load_pretrained(directory, par)" in message, message


def _pieces(par):
    """name -> [(box origin, box sizes, values)] of every tensor this rank holds."""
    from parallel_layers import placement

    return {name: [(p.global_offsets, p.sizes, p.view(t.local).tolist()) for p in t.pieces]
            for name, t in placement.describe(par.module).tensors.items()}


def _meta_load_pipelined(rank, world, directories, tp):
    """Every family of one layout in the same processes (one start-up: imports dominate)."""
    from parallel_layers import hf, init_parallel, parallelize, tensor_parallel
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(tp=tp, pp=2, device="cpu")
    out = {}
    for family, directory in directories.items():
        model = _on_meta(directory)
        par = parallelize(model, ctx, optimizer=_adamw, loss_fn=causal_lm_loss, tp_plan="auto" if tp > 1 else None,
                          pipeline_layers="auto", microbatches=2)
        assert all(p.is_meta for p in par.module.parameters())  # the premise: nothing allocated yet
        hf.load_pretrained(directory, par)  # on ctx.device
        loaded = _pieces(par)
        buffers = {n: b.tolist() for n, b in model.named_buffers() if not b.is_meta}  # rotary: every stage here
        losses = []
        for ids in _batches():
            losses.append(par.forward_backward(ids, ids).item())
            par.step()
            par.zero_grad()
        vocab_parallel = isinstance(model.get_input_embeddings(), tensor_parallel.VocabParallelEmbedding)
        out[family] = (loaded, buffers, losses, _pieces(par), vocab_parallel)
    return out


# tp -> the families loaded into pp=2 x tp stages (Mistral's one key/value head does not split over tp=2)
PIPELINED = {1: ("llama-tied", "mistral"), 2: ("llama-tied", "llama")}


@pytest.mark.parametrize("tp", list(PIPELINED), ids=lambda tp: "pp2" if tp == 1 else f"pp2-tp{tp}")
def test_meta_built_model_loads_into_pipeline_stages(tmp_path, tp):
    """Decoders cut into stages by pipeline_layers='auto': each stage reads the tensors (at tp=2,
    the slices) it holds - a head tied to the embedding at each end of the pipeline from the one
    tensor the files keep - and trains as the plain model does."""
    directories = {family: str(tmp_path / family) for family in PIPELINED[tp]}
    for family, directory in directories.items():
        _save(family, directory)
    results = run_distributed(_meta_load_pipelined, 2 * tp, args=(directories, tp), timeout_s=300)
    for family, directory in directories.items():
        results_of = [r[family] for r in results]
        # an untied embedding is vocabulary-parallel at tp > 1 (the published plan), a tied one not
        assert all(r[-1] == (tp > 1 and family != "llama-tied") for r in results_of), family
        _check_pipelined(directory, [r[:-1] for r in results_of], tied=family == "llama-tied")


def _check_pipelined(directory, results, tied):
    _, ref_losses, ref = _reference(directory)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(directory)
    held = [name for loaded, *_ in results for name in loaded]
    assert sorted(set(held)) == sorted(pretrained.state_dict())  # every tensor on some stage
    if tied:  # the tie's copies at both ends of the pipeline
        assert "lm_head.weight" in results[-1][0] and "model.embed_tokens.weight" in results[0][0]
    for loaded, buffers, losses, after in results:
        for name, pieces in loaded.items():  # exactly the files' values, box by box
            for origin, sizes, values in pieces:
                box = tuple(slice(o, o + n) for o, n in zip(origin, sizes))
                assert torch.equal(torch.tensor(values), pretrained.state_dict()[name][box]), name
        assert buffers and all(torch.equal(torch.tensor(v), pretrained.get_buffer(n)) for n, v in buffers.items())
        # float32; the two microbatches' gradients (and the tie's two copies', and TP's row
        # layers') are summed in another order than one batch: ~1e-7 relative, ~1e-6 after AdamW.
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        for name, pieces in after.items():
            for origin, sizes, values in pieces:
                box = tuple(slice(o, o + n) for o, n in zip(origin, sizes))
                assert torch.allclose(torch.tensor(values), ref.state_dict()[name][box], rtol=1e-4, atol=1e-4), name
    assert not torch.allclose(ref.lm_head.weight, pretrained.lm_head.weight, atol=1e-3)  # the steps moved it


def test_materialize_keeps_identity_attributes_and_hooks():
    """Note [materialize in place]: what refers to a meta tensor still does after materialize."""
    from parallel_layers import meta

    with torch.device("meta"):
        layer = torch.nn.Linear(3, 2)
    weight, calls = layer.weight, []
    weight.tp_shard = "kept"
    weight.register_hook(lambda g: calls.append("grad hook") or g * 2)
    handle = weight.register_post_accumulate_grad_hook(lambda p: calls.append("post-accumulate hook"))
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    meta.materialize(layer, "cpu")
    assert layer.weight is weight and opt.param_groups[0]["params"][0] is weight and weight.tp_shard == "kept"
    assert weight.device.type == "cpu" and not layer.bias.is_meta
    with torch.no_grad():
        weight.fill_(1.0)
        layer.bias.zero_()
    layer(torch.ones(1, 3)).sum().backward()
    assert calls == ["grad hook", "post-accumulate hook"] and torch.equal(weight.grad, torch.full((2, 3), 2.0))
    handle.remove()  # the handles still work
    layer(torch.ones(1, 3)).sum().backward()
    assert calls == ["grad hook", "post-accumulate hook", "grad hook"]


def test_materialized_vocabulary_padding_is_zero():
    """A vocabulary that tp does not divide is padded with rows no file holds; the load leaves
    them as materialize made them, so that must be zeros (the constructor's), not garbage.
    The last of 3 ranks (the fake process group) holds 96 = 3 x 32 rows: 95 real + 1 padding."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel_layers import meta
    from parallel_layers.tensor_parallel import VocabParallelEmbedding

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        with torch.device("meta"):
            emb = VocabParallelEmbedding(95, 8, tp_group=dist.group.WORLD)
        torch.full((32, 8), float("nan"))  # freed memory of the same size, which torch.empty would hand back
        meta.materialize(emb, "cpu")
        assert emb.weight.shape == (32, 8) and torch.equal(emb.weight[-1], torch.zeros(8))
    finally:
        dist.destroy_process_group()


def _load_with_one_bad_rank(rank, model, directory):
    """Rank 1 loads from a directory without safetensors: what each rank raised, or None.
    Without the agreement rank 0 would wait in the load's collectives until the run's timeout."""
    from parallel_layers import hf

    bad = os.path.join(directory, "no-weights")
    try:
        hf.load_pretrained(bad if rank == 1 else directory, model, device="cpu")
    except Exception as e:  # noqa: BLE001 - what each rank raised comes back
        return f"{type(e).__name__}: {e}"
    return None


def _resume_from_meta(rank, world, directory, root):
    import warnings

    from parallel_layers import checkpoint, hf, init_parallel, meta, parallelize

    ctx = init_parallel(tp=2, device="cpu")

    def build():  # what a resumed job builds: nothing allocated until the checkpoint is read
        return parallelize(_on_meta(directory), ctx, optimizer=_adamw, loss_fn=_loss, tp_plan="auto")

    par = build()
    hf.load_pretrained(directory, par)
    ids = _batches()[0]
    par.forward_backward(ids, ids)
    par.step()
    path = checkpoint.save(root, 1, par.module, par.optimizer, prefix=par.prefix)
    with torch.no_grad():
        want = par.module(_probe()).logits

    resumed = build()
    try:  # still on the meta device: refused, naming the fix
        checkpoint.load(path, resumed.module, resumed.optimizer, prefix=resumed.prefix)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    with warnings.catch_warnings(record=True) as caught:  # zeros where no checkpoint holds a value
        warnings.simplefilter("always")
        meta.materialize(build().module, "cpu")
    hf.materialize(resumed)  # the constructor's rotary inv_freq and embed_scale
    checkpoint.load(path, resumed.module, resumed.optimizer, prefix=resumed.prefix)
    with torch.no_grad():
        got = resumed.module(_probe()).logits
    return refusal, [str(w.message) for w in caught], (got - want).abs().max().item()


def test_a_meta_built_model_resumes_from_a_checkpoint(tmp_path):
    # Before hf.materialize, meta.materialize left the rotary inv_freq and Gemma's embed_scale at
    # zero (no checkpoint holds them) and the resumed logits were 1.0 (relative) off, silently.
    _save("gemma-untied", tmp_path / "src")
    for refusal, warned, diff in run_distributed(_resume_from_meta, 2, args=(str(tmp_path / "src"),
                                                                              str(tmp_path / "ckpt")), timeout_s=240):
        assert refusal.startswith("checkpoint load: the model still has tensors on the meta device") and \
            "hf.materialize(model)" in refusal, refusal
        assert any("non-persistent buffer(s) are zeros now" in w and "embed_scale" in w and "inv_freq" in w
                   for w in warned), warned
        assert diff == 0.0


def _load_tied_copies(rank, world, directory):
    from parallel_layers import hf, init_parallel, parallelize

    ctx = init_parallel(dp=world, device="cpu")
    par = parallelize(_on_meta(directory), ctx, optimizer=_adamw, loss_fn=_loss, zero_stage=3)
    try:
        hf.load_pretrained(directory, par)
    except Exception as e:  # noqa: BLE001 - what each rank raised comes back
        return f"{type(e).__name__}: {e}"
    return None


def test_both_copies_of_a_tie_in_the_files_load_as_transformers_loads_them(tmp_path):
    """Note [both copies of a tie in the files]. A tying config over files that hold the head
    and the embedding with different values: transformers unties the model; hf.load_pretrained
    kept the tie, read the embedding into it and warned that the files held 'a tensor the model
    does not have' (the head): it trained another model than from_pretrained's. Now it is
    refused on every rank - also when only one rank's share of the rows differs. Equal copies
    load tied, as transformers loads them, without the warning."""
    import json
    import warnings

    from safetensors.torch import load_file, save_file

    from parallel_layers import hf

    untied = tmp_path / "untied"
    _save("llama", untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(untied)
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight  # what we match
    refused = ("ValueError: hf.load_pretrained: the model ties lm_head.weight to model.embed_tokens.weight (one tensor), "
               f"but {untied} holds both, with different values (a checkpoint of an untied model); transformers' "
               "from_pretrained unties such a model and loads each. Build the model with "
               "config.tie_word_embeddings = False (set on the config before constructing it), then parallelize and "
               "load it; or, to keep the tie, remove 'lm_head.weight' from the files")
    with pytest.raises(ValueError) as raised:
        hf.load_pretrained(untied, _on_meta(untied), device="cpu")
    assert f"ValueError: {raised.value}" == refused

    # only the last row differs: in rank 1's share of the rows, rank 0 raises too
    state = load_file(untied / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["lm_head.weight"][-1] += 1
    save_file(state, untied / "model.safetensors", metadata={"format": "pt"})
    assert run_distributed(_load_tied_copies, 2, args=(str(untied),)) == [refused, refused]

    tied = tmp_path / "tied"  # equal copies: one tied tensor, no warning
    _save("llama-tied", tied)
    state = load_file(tied / "model.safetensors")
    assert "lm_head.weight" not in state  # transformers writes a tie once
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, tied / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tied)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = hf.load_pretrained(tied, _on_meta(tied), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(_probe()).logits, reference(_probe()).logits)
    assert run_distributed(_load_tied_copies, 2, args=(str(tied),)) == [None, None]
