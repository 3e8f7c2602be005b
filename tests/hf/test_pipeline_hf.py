"""An unmodified Hugging Face decoder pipelined by `parallelize(..., pipeline_layers="auto")`
(parallel_layers/pipeline/hf.py): its own modules as the layer list (embedding, decoder layers,
final norm + head), position ids / rotary cos-sin / causal mask rebuilt on every stage.

- in one process, the layers run in a row give the model's logits and `causal_lm_loss` its
  `outputs.loss`, for every supported family (sliding-window masks included), under the model's
  own state_dict names;
  With a padding attention mask (right and left padding) the stages give the model's logits
  for `model(input_ids, attention_mask=...)`, and the loss pair for padded batches its loss;
- at pp=2 (1F1B, 2 microbatches) and pp=2 x tp=2 (the published TP plan), Llama (untied and
  tied head), Qwen2 (biased q/k/v) and GPT-2 (head tied to wte, so the tie crosses stages), and
  Phi-3 (packed qkv / gate_up, sliding window) at pp=2, and an untied Gemma (a vocabulary-parallel
  embedding that scales its rows in its own forward) and Mixtral (experts split as their MLPs) at
  pp=2 x tp=2, train 3 SGD steps to the
  losses and parameters of the plain model loaded from the same directory (one full batch
  without a mask, then two padded batches whose microbatches count different tokens, with
  their attention masks), and `hf.save_pretrained` from the pipelined layout reloads in plain
  transformers with its logits;
- inputs the pipeline cannot carry (a tokenizer's dict, hidden states, a mask of another
  shape) and unsupported models are refused, on every pipeline rank; so is a mask given to a
  pipeline whose layers take none; a refusal raised inside one stage (selective checkpointing of
  OLMo's in-place clip_qkv) reaches every pipeline rank.
"""

import re

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf._tiny import (save_tiny_gemma, save_tiny_gpt2, save_tiny_llama, save_tiny_mixtral, save_tiny_phi3,
                            save_tiny_qwen2)

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, MICROBATCHES = 3, 4, 16, 2
VOCAB = 96  # the smaller of the tiny models' vocabularies


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _padding(step):
    """The attention mask of batch `step` (None: full sequences): rows right-padded to
    different lengths and one left-padded, so that the two microbatches count different tokens."""
    if step == 0:
        return None
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - 5 - step:] = 0
    mask[2, :3] = 0
    mask[3, 4 + step:] = 0
    return mask


def _labels(ids, mask):
    return ids if mask is None else ids.masked_fill(mask == 0, -100)


def _sgd(params):
    # SGD, not AdamW: GPT-2's key bias has a zero true gradient (softmax ignores a shift of every
    # score), so its gradient is rounding noise that differs with the order of sums, and AdamW's
    # normalisation would turn that noise into steps of lr.
    return torch.optim.SGD(params, lr=0.5)


def _tiny_config(family):
    """Small configs of the families not covered by the distributed runs; the sliding windows are
    shorter than the sequence, so a layer given the wrong mask changes the logits."""
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if family == "qwen2":  # layer 0 full attention, layers 1-2 sliding (config.layer_types)
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=8)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
    others = {  # the Llama-style families whose forward is Llama's but for the mask (pipeline/hf.py)
        "gemma": lambda: transformers.GemmaConfig(**common, head_dim=8),
        "olmo": lambda: transformers.OlmoConfig(**common, clip_qkv=0.5, **ids),
        "olmo2": lambda: transformers.Olmo2Config(**common, **ids),
        "glm4": lambda: transformers.Glm4Config(**common, head_dim=8, **ids),
        "nemotron": lambda: transformers.NemotronConfig(**common, head_dim=8, **ids),
        "phi3": lambda: transformers.Phi3Config(**common, sliding_window=4, **ids),
        "smollm3": lambda: transformers.SmolLM3Config(**common, **ids),
        # layers 0 and 2 sliding, layer 1 full (config.layer_types)
        "exaone4": lambda: transformers.Exaone4Config(**common, sliding_window=4, sliding_window_pattern=2,
                                                      head_dim=8, **ids),
        # scalars from the config: the embeddings times embedding_multiplier, the logits over
        # logits_scaling (Granite) or times logit_scale (Cohere)
        "granite": lambda: transformers.GraniteConfig(**common, embedding_multiplier=3.0, logits_scaling=4.0,
                                                      residual_multiplier=0.5, attention_multiplier=0.3, **ids),
        "cohere": lambda: transformers.CohereConfig(**common, logit_scale=0.5, **ids),
        # mixtures of experts (4 experts, 2 per token): Mistral's forward (sliding window), Qwen2's
        # (layer 0 full attention, 1-2 sliding; layer 1 a dense MLP) and Llama's
        "mixtral": lambda: transformers.MixtralConfig(**common, sliding_window=4, num_local_experts=4,
                                                      num_experts_per_tok=2, **ids),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, head_dim=8, use_sliding_window=True,
                                                         sliding_window=4, moe_intermediate_size=32, num_experts=4,
                                                         num_experts_per_tok=2, **ids),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, use_sliding_window=True, sliding_window=4,
                                                         max_window_layers=1, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=48, num_experts=4,
                                                         num_experts_per_tok=2, mlp_only_layers=[1], **ids),
        "olmoe": lambda: transformers.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, **ids),
        # layers 0 and 2 sliding, 1 full; the attention scores and the logits soft-capped (tanh);
        # Gemma 3: another rotary base for the sliding layers, per-head q / k norms
        "gemma2": lambda: _gemma2_config(common, ids),
        "gemma3": lambda: _gemma3_config(common, ids),
    }
    if family in others:
        return others[family]()
    return transformers.MistralConfig(**common, sliding_window=4)


def _gemma2_config(common, ids):
    return transformers.Gemma2Config(**common, head_dim=8, sliding_window=4, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=2.0, query_pre_attn_scalar=8,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"], **ids)


def _gemma3_config(common, ids):
    return transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=4, final_logit_softcapping=2.0,
                                         query_pre_attn_scalar=8,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e4}}, **ids)


def _load(directory, family):
    if family in ("llama", "llama-tied", "gpt2"):
        return transformers.AutoModelForCausalLM.from_pretrained(directory)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_tiny_config(family))


def _save(directory, family):
    if family == "gpt2":
        save_tiny_gpt2(directory)
    elif family.startswith("llama"):
        save_tiny_llama(directory, tie_word_embeddings=family == "llama-tied")
    elif family == "qwen2":  # saved for the distributed runs; the one-process test builds its own (_load)
        save_tiny_qwen2(directory)
    elif family == "gemma-untied":  # its scaled embedding vocabulary-parallel under TP
        save_tiny_gemma(directory, tie_word_embeddings=False)
    elif family == "phi3":
        save_tiny_phi3(directory)
    elif family == "mixtral":  # its experts split as their MLPs under TP (tensor_parallel/experts.py)
        save_tiny_mixtral(directory)
    elif family in ("gemma2", "gemma3"):  # soft-capped logits; Gemma 3's rotary tables per layer type
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_tiny_config(family)).save_pretrained(directory)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "gpt2", "qwen2", "qwen3", "mistral", "gemma", "olmo",
                                    "olmo2", "glm4", "nemotron", "phi3", "smollm3", "exaone4", "granite",
                                    "cohere", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gemma2", "gemma3"])
def test_layers_in_a_row_are_the_model(tmp_path, family):
    from parallel_layers.pipeline import PipelineStages
    from parallel_layers.pipeline.hf import causal_lm_loss, causal_lm_loss_sum, causal_lm_tokens, decoder_layers

    _save(tmp_path, family)
    model = _load(tmp_path, family)
    layers = decoder_layers(model)
    ids = _batches()[0]
    x = ids
    with torch.no_grad():  # both alike, so that attention picks the same kernel
        for layer in layers:
            x = layer(x)
        out = model(input_ids=ids, labels=ids)
    assert torch.equal(x, out.logits)  # the same modules, called as the model's forward calls them
    assert torch.allclose(causal_lm_loss(x, ids), out.loss, rtol=1e-6)
    # the model's own output, as a model called whole (no pipeline) gives the loss (review finding:
    # "tuple indices must be integers or slices"), and labels of another shape named
    assert torch.equal(causal_lm_loss(out, ids), causal_lm_loss(x, ids))
    with pytest.raises(ValueError, match=re.escape(
            f"causal_lm_loss: needs logits [batch, seq, vocab] and labels [batch, seq] of the same batch and sequence "
            f"(the labels are the input ids, -100 where not to learn: the loss shifts them itself); got logits "
            f"{tuple(x.shape)} and labels {tuple(ids[:, 1:].shape)}")):
        causal_lm_loss_sum(x, ids[:, 1:])
    # The adapters mount the model's modules at their own paths: the same state_dict names.
    assert sorted(k for layer in layers for k in layer.state_dict()) == sorted(model.state_dict())
    assert len(layers) == model.config.num_hidden_layers + 2
    # A padded batch: the mask reaches every decoder layer as a side input, as in the model's forward.
    mask = _padding(2)
    labels = _labels(ids, mask)
    with torch.no_grad():
        x = PipelineStages(layers)(ids, attention_mask=mask)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        unmasked = PipelineStages(layers)(ids)
    assert torch.equal(x, out.logits)
    assert not torch.allclose(x, unmasked, atol=1e-3)  # the mask changed the logits
    assert torch.allclose(causal_lm_loss_sum(x, labels) / causal_lm_tokens(labels), out.loss, rtol=1e-6)


def test_unsupported_models_are_refused():
    from parallel_layers.pipeline.hf import SUPPORTED, decoder_layers

    phi = transformers.PhiForCausalLM(transformers.PhiConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32))
    # its model's forward applies a dropout to the embeddings, outside any module we cut: not ours to guess
    with pytest.raises(ValueError, match=r"model_type 'phi'") as e:
        decoder_layers(phi)
    assert all(family in str(e.value) for family in SUPPORTED)
    encoder = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=32, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True .* only causal language models"):
        decoder_layers(encoder)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32, num_local_experts=2, output_router_logits=True))
    # its loss would add the routers' load-balancing loss over every layer: not carried between stages
    with pytest.raises(ValueError, match=r"MixtralForCausalLM has config.output_router_logits=True: .*Set "
                                         r"model.config.output_router_logits = False before parallelize"):
        decoder_layers(mixtral)
    with pytest.raises(ValueError, match="GPT2Model"):  # the base model has no head
        decoder_layers(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))


def test_a_mask_no_layer_takes_is_refused():
    from parallel_layers.pipeline import PipelineParallel, PipelineStages

    pipe = PipelineParallel(PipelineStages([torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)]),
                            microbatches=2, loss_fn=lambda y, t: torch.nn.functional.cross_entropy(y.flatten(0, 1),
                                                                                               t.flatten()))
    ids = _batches()[0]
    assert pipe.step(ids, ids).isfinite()
    with pytest.raises(ValueError, match="no layer of this pipeline takes one"):
        pipe.step(ids, ids, attention_mask=torch.ones_like(ids))


def _train(rank, world, sources, exports, tp, sp=False):
    """Every family of one layout in the same processes (one start-up: imports dominate)."""
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss_sum, causal_lm_tokens

    ctx = init_parallel(tp=tp, pp=2, device="cpu")
    out = {}
    for family, directory in sources.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        # the sum and the batch's token count: Hugging Face's mean over a padded batch's labelled tokens
        par = parallelize(model, ctx, optimizer=_sgd, loss_fn=causal_lm_loss_sum, token_count=causal_lm_tokens,
                          tp_plan="auto" if tp > 1 else None, pipeline_layers="auto", schedule="1f1b",
                          microbatches=MICROBATCHES, sequence_parallel=sp)
        assert par.prefix == "" and type(par.module).__name__ == "PipelineStages"
        # The other stages' layers were freed in the model this rank built whole: only its own stay alive.
        alive = sum(p.numel() for p in model.parameters() if not p.is_meta)
        assert alive == sum(p.numel() for p in par.module.parameters()) < sum(p.numel() for p in model.parameters())
        refusals = []
        if family == "llama":  # every pipeline rank raises, whichever rank holds the bad input
            ids = _batches()[0]
            for bad, mask in (({"input_ids": ids, "attention_mask": torch.ones(BATCH, SEQ)}, None),
                              (torch.randn(BATCH, SEQ, model.config.hidden_size), None),
                              (ids, torch.ones(BATCH, SEQ - 1, dtype=torch.int64))):
                try:
                    par.forward_backward(bad, ids, attention_mask=mask)
                except (TypeError, ValueError) as e:
                    refusals.append(str(e))
        losses = []
        for step, ids in enumerate(_batches()):
            mask = _padding(step)
            losses.append(par.forward_backward(ids, _labels(ids, mask), attention_mask=mask).item())
            par.step()
            par.zero_grad()
        hf.save_pretrained(par.module, exports[family])
        # The copy of a tied weight on this rank (stage 0's embedding or the last stage's head).
        tied = model.get_output_embeddings().weight
        out[family] = (losses, tied.tolist() if tied is model.get_input_embeddings().weight else None, refusals)
    return out


def _reference(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    opt = _sgd(model.parameters())
    losses = []
    for step, ids in enumerate(_batches()):
        mask = _padding(step)  # Hugging Face's own loss
        loss = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


# (tp, sequence parallel) -> the families trained at pp=2 x tp (tied: the head is the input
# embedding, on the other stage). With sequence parallelism the stage boundary carries each tp
# rank's chunk of the sequence (Note [sequence parallelism across stages] in pipeline/hf.py),
# with the padded batches' masks as side inputs.
LAYOUTS = {(1, False): ("llama", "llama-tied", "gpt2", "qwen2", "phi3"),
           (2, False): ("llama", "gpt2", "qwen2", "gemma-untied", "mixtral", "gemma2"),
           (2, True): ("llama", "gpt2", "qwen2", "mixtral", "gemma3")}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "pp2" if layout[0] == 1 else
                         f"pp2-tp{layout[0]}" + ("-sp" if layout[1] else ""))
def test_pipelined_decoder_matches_the_plain_model(tmp_path, layout):
    tp, sp = layout
    sources = {f: str(tmp_path / f / "src") for f in LAYOUTS[layout]}
    exports = {f: str(tmp_path / f / "out") for f in LAYOUTS[layout]}
    for family, directory in sources.items():
        _save(directory, family)
    results = run_distributed(_train, 2 * tp, args=(sources, exports, tp, sp), timeout_s=300)
    for family in LAYOUTS[layout]:
        _check_family(family, sources[family], exports[family], [r[family] for r in results])


def _check_family(family, source, export, results):
    ref_losses, ref = _reference(source)
    # float32; the pipeline sums the two microbatches' gradients (and TP its row layers) in
    # another order than one batch: ~1e-7 relative per step.
    for losses, tied, refusals in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4), family
        if tied is not None:  # each stage's copy took the step of the summed gradient
            assert torch.allclose(torch.tensor(tied), ref.get_input_embeddings().weight, rtol=1e-4, atol=1e-5)
        if family == "llama":
            assert len(refusals) == 3, refusals
            assert "one tensor" in refusals[0] and "attention_mask=" in refusals[0]
            assert "token ids [batch, seq]" in refusals[1] and "float32" in refusals[1]
            assert f"inputs' shape [{BATCH}, {SEQ}]" in refusals[2] and f"[{BATCH}, {SEQ - 1}]" in refusals[2]
    tied_head = transformers.AutoConfig.from_pretrained(source).tie_word_embeddings  # a tied Llama, GPT-2, Gemma 2, 3
    assert family not in ("llama-tied", "gpt2") or tied_head
    assert sum(t is not None for _, t, _ in results) == (len(results) if tied_head else 0)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    ref_state, got_state = ref.state_dict(), exported.state_dict()
    assert got_state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        assert torch.allclose(got_state[name], value, rtol=1e-4, atol=1e-5), (family, name)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(source)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, want, before = (m(input_ids=ids).logits for m in (exported, ref, pretrained))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), family
    assert not torch.allclose(got, before, atol=1e-3)  # trained weights, not the pretrained ones


def _train_dp(rank, world, directory, exports):
    """dp=2 over padded batches whose halves count different tokens: DataParallel, ZeRO-3, and the
    pipeline runtime (2 microbatches at pp=1) over ZeRO-1."""
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss_sum, causal_lm_tokens

    ctx = init_parallel(dp=2, device="cpu")
    dp_rank = ctx.coordinate("dp")
    out = {}
    for name, kwargs in (("dataparallel", dict(zero_stage=0)), ("zero3", dict(zero_stage=3)),
                         ("pipeline-runtime-zero1", dict(zero_stage=1, pipeline_layers="auto", microbatches=2))):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        piped = "pipeline_layers" in kwargs
        loss_fn = causal_lm_loss_sum if piped else (lambda o, labels: causal_lm_loss_sum(o.logits, labels))
        par = parallelize(model, ctx, optimizer=_sgd, loss_fn=loss_fn, token_count=causal_lm_tokens, **kwargs)
        losses, counts = [], []
        for step, ids in enumerate(_batches()):
            mask = _padding(step)
            mine = ids.chunk(2)[dp_rank]
            mine_mask = None if mask is None else mask.chunk(2)[dp_rank]
            labels = _labels(mine, mine_mask)
            counts.append(int(causal_lm_tokens(labels)))
            loss = par.forward_backward(mine, labels, attention_mask=mine_mask).clone()
            torch.distributed.all_reduce(loss)  # the replicas' mean: the whole batch's token mean
            losses.append(loss.item() / 2)
            par.step()
            par.zero_grad()
        hf.save_pretrained(par.module, f"{exports}/{name}")
        out[name] = (losses, counts)
    return out


def test_token_mean_over_data_parallel_replicas(tmp_path):
    # Note [token mean over data parallelism]: each replica's sum is divided by the count of the
    # whole batch, so the step is Hugging Face's loss of the whole padded batch, not the mean of
    # the replicas' means (1.6e-3 off that loss and 1e-1 off its parameters before).
    _save(tmp_path, "llama")
    ref_losses, ref = _reference(str(tmp_path))
    results = run_distributed(_train_dp, 2, args=(str(tmp_path), str(tmp_path / "out")), timeout_s=300)
    ref_state = ref.state_dict()
    for name in results[0]:
        for r in results:
            assert r[name][0] == pytest.approx(ref_losses, rel=1e-5), name
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / name).state_dict()
        for key, value in ref_state.items():
            assert torch.allclose(exported[key], value, rtol=1e-4, atol=1e-6), (name, key)
    counts = [r["dataparallel"][1] for r in results]
    assert counts[0][1:] != counts[1][1:]  # the premise: the padded halves count different tokens


def _refused_inside_a_stage(rank, world, directory):
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss_sum, causal_lm_tokens

    ctx = init_parallel(pp=2, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    # No wrap=: the blocks are the model's declared ones (its _no_split_modules, the decoder layers).
    par = parallelize(model, ctx, optimizer=_sgd, loss_fn=causal_lm_loss_sum, token_count=causal_lm_tokens,
                      pipeline_layers="auto", microbatches=MICROBATCHES, activation_checkpointing="selective")
    ids = _batches()[0]
    try:
        par.forward_backward(ids, ids)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_refusal_inside_a_stage_reaches_every_pipeline_rank(tmp_path):
    # OLMo's clip_qkv clamps the q / k / v projections' outputs in place, which selective
    # checkpointing keeps: refused inside stage 0's forward, on pipeline rank 0 only. Rank 1
    # raises it too, at the step's end, instead of waiting for stage 0's activations
    # (Note [a failed stage] in pipeline/_p2p.py).
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_tiny_config("olmo")).save_pretrained(tmp_path)
    refused, peer = run_distributed(_refused_inside_a_stage, 2, args=(str(tmp_path),), collective_timeout_s=30)
    assert refused.startswith("activation_checkpointing='selective': aten.clamp_.default writes in place into the "
                              "output of a kept GEMM")
    assert peer == f"pipeline rank 0 raised RuntimeError in the forward of stage 0, microbatch 0: {refused}"
