"""tensor_parallel.parallelize() on real Hugging Face models built from small configs (no
weights are downloaded): GPT-2 (Conv1D, fused QKV) and Llama (separate q/k/v, grouped KV heads)
at tp=2 give the single-process logits and loss, and the same parameters after AdamW steps."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers.tensor_parallel import Column, Experts, VocabParallel, gather_full, parallelize
from tests.dist_harness import run_distributed
from tests.tensor_parallel.test_layers import _count_collectives

transformers = pytest.importorskip("transformers")

GPT2_PLAN = {
    "transformer.h.*.attn.c_attn": Column(fused=3),
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
}
LLAMA_PLAN = {
    "model.layers.*.self_attn.[qkv]_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
}
# float32: the row layers change the order of one sum per layer; SGD steps keep the
# difference at that level. 1e-5 relative on logits, loss and parameters.
RTOL = 1e-5


def _build(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config), GPT2_PLAN
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    if kind == "qwen2":  # biases on q, k, v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)), LLAMA_PLAN
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**small)), LLAMA_PLAN
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the vocabulary
    others = {  # Llama-style families with sequence parallelism (hf_sequence_parallel.FAMILIES)
        "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**small, head_dim=8)),
        "olmo": lambda: transformers.OlmoForCausalLM(transformers.OlmoConfig(**small, clip_qkv=0.5, **ids)),
        "nemotron": lambda: transformers.NemotronForCausalLM(transformers.NemotronConfig(**small, head_dim=8, **ids)),
        "smollm3": lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**small, **ids)),
        "exaone4": lambda: transformers.Exaone4ForCausalLM(transformers.Exaone4Config(**small, head_dim=8, **ids)),
        # and families whose published plans take other paths: gathered q / k / v outputs (OLMo 2),
        # gathered packed outputs (GLM and GLM-4's gate_up_proj, Phi-3's qkv_proj and gate_up_proj;
        # these have sequence parallelism too), multipliers (Granite), soft-capping and
        # sliding windows (Gemma 2), a fused per-head QKV and a renamed head (GPT-NeoX), biases and
        # a LayerNorm MLP (StarCoder2)
        "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**small, **ids)),
        "glm4": lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**small, head_dim=8, **ids)),
        "glm": lambda: transformers.GlmForCausalLM(transformers.GlmConfig(**small, head_dim=8, **ids)),
        "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**small, **ids)),
        # learned scalars in the MLP's activation (xIELU's alpha_p, alpha_n: Apertus's MLP), applied to
        # gate_proj's sharded output: their gradients summed (Note [scalars in a TP region])
        "llama_xielu": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, hidden_act="xielu")),
        "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **small, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3,
            **ids)),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **small, head_dim=8, sliding_window=8, final_logit_softcapping=5.0, attn_logit_softcapping=10.0)),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
            max_position_embeddings=32, tie_word_embeddings=False, **ids)),
        "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**small, **ids)),
        # mixtures of experts (tensor_parallel/experts.py): 4 experts, 2 per token, each split as its MLP
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2, **ids)),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **small, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **ids)),
        # a shared expert beside the routed ones, and layer 1 a dense MLP (mlp_only_layers)
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **small, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[1], **ids)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, **ids)),
    }
    if kind in others:
        return others[kind](), None
    if kind.endswith("_whole_experts"):  # each rank whole experts (Note [whole experts per rank])
        from parallel_layers.tensor_parallel import published_plan

        model = others[kind.removesuffix("_whole_experts")]()
        plan = published_plan(model)
        return model, {**plan, "model.layers.*.mlp.experts": Experts(split="experts")}
    if kind == "gemma3":  # the same per-head norms (Gemma's 1 + weight form), GeGLU MLP, tied head
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**small, head_dim=8)), None
    if kind == "gemma3_untied":  # its embedding vocabulary-parallel: a subclass that scales the rows
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**small, head_dim=8,
                                                                            tie_word_embeddings=False)), None
    if kind == "cohere_qk_norm":  # q_norm / k_norm: LayerNorms with a [heads, head_dim] weight; tied head
        return transformers.CohereForCausalLM(transformers.CohereConfig(**small, use_qk_norm=True)), None
    if kind == "phi_qk_norm":  # q_layernorm / k_layernorm of head_dim on each head; its plan does not name them
        return transformers.PhiForCausalLM(transformers.PhiConfig(**small, qk_layernorm=True)), None
    if kind == "qwen3":  # per-head RMSNorms q_norm / k_norm on q_proj's and k_proj's sharded heads
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=8)), \
            {**LLAMA_PLAN, "model.layers.*.self_attn.[qk]_norm": "replicated"}
    if kind == "llama_unfused":  # built the same; parallelized with fused_kernels=False
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)), LLAMA_PLAN
    if kind == "llama_vocab":  # the embedding split on the vocabulary too, by transformers' spelling
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)), \
            {**LLAMA_PLAN, "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)), LLAMA_PLAN


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _full_params(model, group):
    return {n: gather_full(p, group) if hasattr(p, "tp_shard") else p.detach() for n, p in model.named_parameters()}


def _hf_parity(rank, ws, kind, steps, directory=None, plan_free=False):
    group = dist.group.WORLD
    ref, plan = _build(kind)
    if plan_free:  # the model's published plan (GPT-2: the built-in one)
        plan = None
    fused = kind != "llama_unfused"
    if directory is None:
        par = parallelize(copy.deepcopy(ref), plan, tp_group=group, fused_kernels=fused)
    else:  # both loaded from save_pretrained's files: parameters in memory-mapped storage
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
        par = parallelize(transformers.AutoModelForCausalLM.from_pretrained(directory), plan, tp_group=group,
                          fused_kernels=fused)
    ref.train()
    par.train()
    g = torch.Generator().manual_seed(1)
    # SGD, not AdamW: attention's key bias has an exactly-zero true gradient (softmax ignores
    # it), and Adam would blow the rounding noise in it up to full lr-sized steps in different
    # directions on the two models. AdamW parity is covered by tests/tensor_parallel/test_layers.py.
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_par = torch.optim.SGD(par.parameters(), lr=0.1)
    worst = {"logits": 0.0, "loss": 0.0}
    for _ in range(steps):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        out_ref = ref(input_ids=ids, labels=ids)
        out_par = par(input_ids=ids, labels=ids)
        worst["logits"] = max(worst["logits"], _rel(out_par.logits.detach(), out_ref.logits.detach()))
        worst["loss"] = max(worst["loss"], abs(out_par.loss.item() - out_ref.loss.item()) / out_ref.loss.item())
        out_ref.loss.backward()
        out_par.loss.backward()
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    # Parameter names differ where a Conv1D became a parallel layer: compare by role.
    ref_params = dict(ref.named_parameters())
    ref_modules = dict(ref.named_modules())
    for name, full in _full_params(par, group).items():
        want = ref_params[name].detach()
        owner = ref_modules[name.rpartition(".")[0]]
        if type(owner).__name__ == "Conv1D" and name.endswith("weight"):  # Conv1D: [in, out]; ours: [out, in]
            want = want.t()
        worst[f"param {name}"] = _rel(full, want)
    sharded = sum(hasattr(p, "tp_shard") for p in par.parameters())
    ids = torch.randint(0, 96, (2, 16), generator=g)
    out = par(input_ids=ids, labels=ids)
    with _count_collectives() as backward:
        out.loss.backward()
    return worst, sharded, backward["all_reduce"]


# Input-gradient all-reduces of one backward (2 decoder layers), Note [one reduction per region]:
# per Llama layer one at the attention's entry for q, k and v, and the MLP's one (SwiGLUMLP's;
# unfused: its region's entry for gate and up); GPT-2's packed c_attn and its c_fc one each.
# Plus the untied head's column layer (published plans, llama_vocab). Per-layer reductions were
# 4 a Llama layer (q, k, v, the fused MLP), 5 unfused.
# Qwen3: Llama's two per layer, plus the gradient sums of q_norm and k_norm; plan-free, the
# untied head's too. Gemma 3 (no region layout of hf_sequence_parallel's, a GeGLU MLP that
# SwiGLUMLP does not take): q, k, v, gate and up one each, and the two norms', per layer.
# Cohere (no region layout either): q, k, v and SwiGLUMLP's one per layer; its per-head norms are
# sharded with the heads, so nothing is summed for them (Note [per-head parameters]). Phi with
# qk_layernorm: q, k, v and fc1 one each, and the weight and bias of q_layernorm and k_layernorm
# (head_dim each, summed: Note [per-head parameters]) per layer, and the untied head's.
BACKWARD_ALL_REDUCES = {"gpt2": 4, "llama": 4, "llama_unfused": 4, "llama_vocab": 5, "plan_free": 5, "qwen3": 8,
                        "qwen3_plan_free": 9,
                        "cohere_qk_norm_plan_free": 8, "phi_qk_norm_plan_free": 17,
                        # with a region layout (hf_sequence_parallel.FAMILIES): two a layer, + the untied head's
                        "gemma_plan_free": 4, "smollm3_plan_free": 4, "olmo_plan_free": 5, "nemotron_plan_free": 5,
                        "exaone4_plan_free": 9,  # + q_norm and k_norm's sums
                        # Gemma 2, Gemma 3 (with regions since session 38): + Gemma 3's q_norm and
                        # k_norm sums (+ the untied head's); without them they took 10, 14 and 15
                        "gemma2_plan_free": 4, "gemma3_plan_free": 8, "gemma3_untied_plan_free": 9,
                        # GLM, GLM-4, OLMo 2: their regions gather their column layers' outputs, and share
                        # one input all-reduce all the same (q, k, v's; gate_up_proj's or the fused MLP's)
                        "glm_plan_free": 5, "glm4_plan_free": 5, "olmo2_plan_free": 5,
                        "phi3_plan_free": 5,  # packed qkv_proj and gate_up_proj: one each
                        "llama_xielu_plan_free": 9,  # Llama's 5, + alpha_p and alpha_n's sums in each layer
                        # without one: each column layer's own (q, k, v; the MLP's one), + the head's
                        "granite_plan_free": 9, "starcoder2_plan_free": 8,
                        "gpt_neox_plan_free": 5,  # packed qkv: one
                        # mixtures of experts: the experts' two, their inputs' (the hidden states' and the
                        # routing weights'; Note [experts split like their MLP]) a layer, and attention's:
                        # one for q, k and v with a region layout (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE:
                        # gathered outputs), else one each; + the head's. Qwen3-MoE + q_norm and k_norm's
                        # sums; Qwen2-MoE's layer 1 is dense (SwiGLUMLP's one) and its shared expert stays
                        # whole (its plan names none)
                        "mixtral_plan_free": 7, "qwen3_moe_plan_free": 11, "olmoe_plan_free": 7,
                        "qwen2_moe_plan_free": 6, "mixtral_whole_experts": 7, "qwen3_moe_whole_experts": 11}


@pytest.mark.parametrize("kind,pretrained", [("gpt2", False), ("llama", False), ("gpt2", True), ("llama", True),
                                             ("llama_vocab", True), ("llama_unfused", False), ("qwen3", False),
                                             ("mixtral_whole_experts", True), ("qwen3_moe_whole_experts", True)])
def test_hf_model_parallelized_matches_single_process(kind, pretrained, tmp_path):
    directory = None
    if pretrained:
        _build(kind)[0].save_pretrained(tmp_path)
        directory = str(tmp_path)
    _check_parity(_hf_parity, (kind, 3, directory), all_reduces=BACKWARD_ALL_REDUCES[kind])


def _check_parity(fn, args, all_reduces, min_sharded=1):
    for rank, (worst, sharded, backward_all_reduces) in enumerate(run_distributed(fn, 2, args=args, timeout_s=300)):
        assert sharded >= min_sharded
        bad = {k: v for k, v in worst.items() if not v < RTOL}
        assert not bad, f"rank {rank}: relative errors above {RTOL}: {bad}"
        assert backward_all_reduces == all_reduces, (rank, backward_all_reduces)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2", "qwen3", "gemma3", "gemma3_untied",
                                  "cohere_qk_norm", "phi_qk_norm", "gemma", "gemma2", "olmo", "olmo2", "glm", "glm4",
                                  "nemotron", "phi3", "smollm3", "exaone4", "granite", "gpt_neox", "starcoder2",
                                  "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "llama_xielu"])
def test_plan_free_from_pretrained_matches_single_process(kind, tmp_path):
    # No plan: Llama, Qwen2 and Mistral publish theirs (q/k/v/gate/up "colwise", o/down
    # "rowwise", the untied lm_head "colwise_gather_output", the embedding "embedding_rowwise":
    # vocabulary-parallel); GPT-2 publishes none and gets the built-in one. 2 layers x (q, k, v,
    # o, gate, up, down) + lm_head + embedding = 16 sharded weights (plus q/k/v biases for
    # Qwen2); GPT-2: 2 layers x (c_attn weight and bias, c_fc weight and bias, the two row
    # weights) = 12 (row biases stay replicated; its head is tied, so its embedding too).
    _build(kind)[0].save_pretrained(tmp_path)
    # Qwen3 and Gemma 3 publish "replicated_with_grad_allreduce" for q_norm / k_norm (Replicated());
    # The other families: 2 layers x their sharded weights (and column biases), + an untied
    # head and its embedding (Gemma, Gemma 2, SmolLM3 and StarCoder2 tie them; GPT-NeoX's plan
    # shards its head only; Phi-3 and GLM-4 pack q/k/v or gate/up into one weight).
    # Cohere with use_qk_norm (tied head): 14, and its [heads, head_dim] q_norm / k_norm weights
    # sharded with the heads, 18 (Note [per-head parameters]).
    # Mixtures of experts: 2 layers x (q, k, v, o, the experts' gate_up_proj and down_proj), + head
    # and embedding: 14; Qwen2-MoE: + q, k, v biases, its dense layer 1's gate, up and down for
    # layer 1's experts: 21.
    # Gemma 3's head is tied, so its embedding and head stay replicated: 14 sharded weights. Untied,
    # its scaled embedding (an nn.Embedding subclass) is vocabulary-parallel: 16, and one more
    # all-reduce, the head's (Note [nn.Embedding subclasses]).
    _check_parity(_hf_parity, (kind, 3, str(tmp_path), True),
                  min_sharded={"gpt2": 12, "gemma3": 14, "cohere_qk_norm": 18, "gemma": 14, "gemma2": 14,
                               "smollm3": 14, "nemotron": 14, "glm": 20, "glm4": 20, "starcoder2": 20, "phi3": 10,
                               "gpt_neox": 13, "mixtral": 14, "qwen3_moe": 14, "olmoe": 14,
                               "qwen2_moe": 21}.get(kind, 16),
                  all_reduces=BACKWARD_ALL_REDUCES.get(f"{kind}_plan_free", BACKWARD_ALL_REDUCES["plan_free"])
                  if kind != "gpt2" else BACKWARD_ALL_REDUCES["gpt2"])


def test_hf_style_names_in_a_plan_and_refused_ones():
    from parallel_layers.tensor_parallel import published_plan

    model, _ = _build("llama")
    plan = published_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == Column() and plan["lm_head"] == Column(gather_output=True)
    assert model._tp_plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.embed_tokens"] == VocabParallel()
    tied, _ = _build("llama")
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    # a head tied by parameter: both ends of the tie stay replicated (Note [published plans])
    assert "lm_head" not in published_plan(tied) and "model.embed_tokens" not in published_plan(tied)
    with pytest.raises(ValueError, match=r"VocabParallel\(\) on model.embed_tokens would untie it from "
                                         r"\['lm_head.weight'\]"):
        parallelize(tied, {"model.embed_tokens": "embedding_rowwise"})
    model._tp_plan = {**model._tp_plan, "model.norm": "sequence_parallel"}
    with pytest.raises(ValueError, match="published plan asks 'sequence_parallel' for 'model.norm' "
                                         r"\(e.g. \['model.norm'\]\); supported Hugging Face styles"):
        published_plan(model)
    with pytest.raises(ValueError, match="publishes no tensor-parallel plan"):
        published_plan(nn.Sequential(nn.Linear(2, 2)))


def _plans_without_the_norms(rank, ws):
    results = {}
    _, plan = _build("qwen3")
    without_norms = {k: v for k, v in plan.items() if not k.endswith("_norm")}
    for case, kwargs, chosen in (("tp2", {}, without_norms),
                                 # sequence parallelism sums every replicated parameter of the layers
                                 ("tp2 sp", {"sequence_parallel": True}, without_norms),
                                 # attention left whole: q_norm reads every head on every rank
                                 ("tp2 mlp only", {}, {k: v for k, v in without_norms.items() if ".mlp." in k})):
        model, _ = _build("qwen3")
        try:
            parallelize(model, chosen, tp_group=dist.group.WORLD, **kwargs)
            results[case] = getattr(model.model.layers[0].self_attn.q_norm.weight, "_pl_tp_grad_hook", False)
        except ValueError as e:
            results[case] = str(e)
    return results


def test_a_plan_that_drops_a_published_gradient_sum_is_refused():
    for results in run_distributed(_plans_without_the_norms, 2, timeout_s=300):
        assert re.fullmatch(r"parallelize: the plan shards column layers beside \['model.layers.0.self_attn.q_norm', "
                            r"'model.layers.0.self_attn.k_norm', .*published plan marks "
                            r"'replicated_with_grad_allreduce'.*Add "
                            r"'model.layers.\*.self_attn.q_norm': 'replicated', "
                            r"'model.layers.\*.self_attn.k_norm': 'replicated' to the plan, .*", results["tp2"])
        assert results["tp2 sp"] is True  # accepted, and its gradient summed
        assert results["tp2 mlp only"] is False  # accepted, nothing to sum
    # tp = 1 (no process group): nothing is sharded, nothing refused
    model, plan = _build("qwen3")
    parallelize(model, {k: v for k, v in plan.items() if not k.endswith("_norm")})


class _Wrapper(nn.Module):
    """A wrapper that reaches its model's config and published plan under other module names (as
    peft's PeftModel does through __getattr__)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self._tp_plan = model, model.config, model._tp_plan


def test_a_published_plan_that_matches_no_module_is_refused():
    """helper-47: the published plan of the model inside a wrapper matched none of the wrapper's
    names; each entry was skipped as a variant's, and tp=2 converted nothing, silently."""
    model, _ = _build("llama")
    assert model._tp_plan  # what the wrapper reaches
    with pytest.raises(ValueError, match=r"parallelize: _Wrapper's published plan \(\d+ entries, e\.g\. "
                                         r"'lm_head'\) matches none of its modules "
                                         r"\(e\.g\. \['inner', 'inner\.model'\]\), so nothing would be split"):
        parallelize(_Wrapper(model))


def _refusals(rank, ws):
    messages = []
    model, _ = _build("llama")  # 4 heads, 2 key/value heads: tp=3 divides neither
    for plan in ({"model.layers.*.self_attn.k_proj": "column"}, {"model.nothing.*": "row"},
                 {"model.norm": "column"}):
        try:
            parallelize(copy.deepcopy(model), plan, tp_group=dist.group.WORLD)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_refuses_plans_that_would_be_wrong_on_every_rank():
    for messages in run_distributed(_refusals, 3, timeout_s=300):
        assert len(messages) == 3
        assert "sharding a projection block of 16 features (2 heads) over tp=3" in messages[0]
        assert ("must be divisible by tp=3 (config.num_attention_heads = 4, config.num_key_value_heads = 2; "
                "valid tp: [1, 2])") in messages[0]
        assert "plan pattern 'model.nothing.*' matches no module of LlamaForCausalLM" in messages[1]
        assert "LlamaRMSNorm is not supported" in messages[2]


def _odd_vocabulary(rank, ws):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    try:
        parallelize(model, {**LLAMA_PLAN, "lm_head": "colwise_gather_output"}, tp_group=dist.group.WORLD)
    except ValueError as e:
        return str(e), type(model.model.layers[0].self_attn.q_proj).__name__
    return None, None


def test_a_vocabulary_tp_does_not_divide_names_the_head_and_the_padding():
    for message, q_proj in run_distributed(_odd_vocabulary, 2, timeout_s=300):
        assert message == (
            "parallelize: lm_head (column-parallel) has out_features 97, and 97 does not divide by tp=2; valid "
            "tensor-parallel sizes for it are [1]. It is the output head: its vocabulary (97) must divide by tp; "
            "pad it, e.g. model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=2) before parallelize "
            "(the embedding grows with it)")
        assert q_proj == "Linear"  # refused before any module was converted


def test_bad_style():
    with pytest.raises(ValueError, match="use 'column', 'row', 'replicated', 'experts', Column\\(...\\), "
                                         "Row\\(...\\), VocabParallel\\(...\\), Replicated\\(\\), "
                                         "Experts\\(...\\) or 'fused', or a Hugging Face style"):
        parallelize(nn.Sequential(nn.Linear(2, 2)), {"0": "diagonal"})


def test_vocab_parallel_needs_an_embedding():
    with pytest.raises(TypeError, match="VocabParallel\\(\\) needs an nn.Embedding, but 0 is Linear"):
        parallelize(nn.Sequential(nn.Linear(2, 2)), {"0": VocabParallel()})


def test_fused_needs_a_column_that_applies_it():
    model = nn.Sequential(nn.Linear(2, 4), nn.GELU(approximate="tanh"), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="plan names 1 \\(GELU\\) 'fused', but Sequential has no "
                                         "Column\\(activation=...\\) layer that applies it"):
        parallelize(model, {"0": "column", "1": "fused", "2": "row"})
    # an exact-GeLU Column does not apply a tanh GeLU
    with pytest.raises(ValueError, match="plan names 1 \\(GELU\\) 'fused'"):
        parallelize(copy.deepcopy(model), {"0": Column(activation="gelu"), "1": "fused", "2": "row"})
    converted = parallelize(copy.deepcopy(model), {"0": Column(activation="gelu_tanh"), "1": "fused", "2": "row"})
    assert isinstance(converted[1], nn.Identity)


def test_which_regions_share_one_input_reduction():
    """Note [one reduction per region], decided at conversion (the fake process group, tp=2, no
    forward): attention's q, k and v share the region's all-reduce; the fused MLP keeps its own
    (overlapped with its weight-gradient GEMM), the unfused one shares; a region that holds a
    linear left replicated is left alone, as is GPT-2's single column layer per region."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def shared(kind, plan=None, **kwargs):
        model = parallelize(_build(kind)[0], plan, tp_group=dist.group.WORLD, **kwargs)
        return sorted(name.removeprefix("model.layers.0.").removeprefix("transformer.h.0.")
                      for name, m in model.named_modules()
                      if getattr(m, "shared_input", False) and name.startswith(("model.layers.0.", "transformer.h.0.")))

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        attention, mlp = ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]
        assert shared("llama") == attention
        assert shared("llama", fused_kernels=False) == mlp + attention
        v_replicated = {k: v for k, v in LLAMA_PLAN.items() if "[qkv]" not in k}
        v_replicated["model.layers.*.self_attn.[qk]_proj"] = "column"
        assert shared("llama", v_replicated, fused_kernels=False) == mlp
        assert shared("gpt2") == []
        # under sequence parallelism every column layer of a region reads its gathered input
        assert shared("llama", sequence_parallel=True, fused_kernels=False) == mlp + attention
    finally:
        dist.destroy_process_group()


def _expert_refusals(rank, ws):
    messages = []
    model, _ = _build("mixtral")
    group = dist.group.WORLD
    for plan in ({"model.layers.*.mlp.experts": "experts"},  # 64 intermediate features per expert, tp=3
                 {"model.layers.*.mlp.experts": Experts(split="experts")},  # 4 experts, tp=3
                 {"model.layers.*.mlp.experts.down_proj": "rowwise"},  # a parameter, without its module's entry
                 {"model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.experts.down_proj": "colwise"}):
        try:
            parallelize(copy.deepcopy(model), plan, tp_group=group)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_experts_refusals_name_the_values():
    """Mixtures of experts (tensor_parallel/experts.py): what Experts() cannot split is refused
    on every rank, before anything is converted."""
    for messages in run_distributed(_expert_refusals, 3, timeout_s=300):
        assert len(messages) == 4
        assert messages[0] == ("parallelize: model.layers.0.mlp.experts: MixtralExperts has intermediate size 64 per "
                               "expert, which does not divide by tp=3; valid tensor-parallel sizes for it are "
                               "[1, 2, 4, 8, 16, 32, 64]")
        assert messages[1] == ("parallelize: model.layers.0.mlp.experts: MixtralExperts has 4 experts (num_experts = "
                               "4); Experts(split='experts') needs num_experts to match and to divide by tp=3; valid "
                               "tensor-parallel sizes for it are [1, 2, 4]")
        messages = messages[:1] + messages[2:]
        assert messages[1].startswith("parallelize: plan pattern 'model.layers.*.mlp.experts.down_proj' names "
                                      "parameters (model.layers.0.mlp.experts.down_proj), not modules")
        assert messages[2].startswith("parallelize: plan['model.layers.*.mlp.experts.down_proj'] = 'colwise', but "
                                      "model.layers.0.mlp.experts is Experts(")
    # the matching spelling of transformers' published plan is accepted, and a layout Experts() does
    # not split (GPT-OSS: experts stored transposed, with biases, gate and up interleaved) is refused
    model, _ = _build("mixtral")
    parallelize(model, {"model.layers.*.mlp.experts": "moe_tp_experts",
                        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                        "model.layers.*.mlp.experts.down_proj": "rowwise"})
    assert type(model.model.layers[0].mlp.experts).__name__ == "TensorParallelMixtralExperts"
    oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"parallelize: model.layers.0.mlp.experts: GptOssExperts holds parameters "
                                         r"\['down_proj', 'down_proj_bias', 'gate_up_proj', 'gate_up_proj_bias'\]"):
        parallelize(oss, {"model.layers.*.mlp.experts": "experts"})
    model, _ = _build("mixtral")
    model.model.layers[1].mlp.experts.is_transposed = True  # [experts, in, out]: what the flag says
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts: MixtralExperts has \{'is_transposed': True\}; "
                                         r"Experts\(\) supports"):
        parallelize(model, {"model.layers.*.mlp.experts": "experts"})
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"  # nothing converted
    with pytest.raises(ValueError, match=r"Experts\(split='rows'\): split must be one of \['intermediate', 'experts'\]"):
        Experts(split="rows")
    # parallelize run twice would split the split experts again: refused
    model, _ = _build("mixtral")
    parallelize(model, {"model.layers.*.mlp.experts": "experts"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: TensorParallelMixtralExperts is split over "
                                         r"tensor-parallel ranks already \(parallelize ran on it\)"):
        parallelize(model, {"model.layers.*.mlp.experts": "experts"})


def _sgd_losses(model, steps, lr, weight_decay=0.0):
    """The losses of `steps` SGD steps on fixed random token ids (ids >= 3: no special token)."""
    from tests.hf._tiny import train_losses
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    return train_losses(model, optimizer, steps, vocab=96, low=3)


def _idle_experts(rank, ws, impl, sequence_parallel):
    """Routers zeroed: every logit ties, so every token goes to the same two experts (topk's
    tie-break picks them; 2 and 3 on the CPU) - one TP rank's under Experts(split="experts"),
    whose peer's experts get no token."""
    ref, _ = _build("mixtral")
    ref.config._experts_implementation = impl
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.gate.weight.zero_()
    par = copy.deepcopy(ref)
    from parallel_layers.tensor_parallel import published_plan
    parallelize(par, {**published_plan(par), "model.layers.*.mlp.experts": Experts(split="experts")},
                tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel)
    _, _, picked = ref.model.layers[0].mlp.gate(torch.randn(5, 32))  # the router's choice for any token
    idle = not any(2 * rank <= e < 2 * rank + 2 for e in picked.flatten().tolist())  # this rank's experts unused
    # weight decay: the idle rank's experts must get a (zero) gradient, as the plain model's
    # stacked experts do, or the decay skips them
    worst = {model is par: _sgd_losses(model, steps=2, lr=0.1, weight_decay=0.1) for model in (ref, par)}
    params = _full_params(par, dist.group.WORLD)
    return worst, max(_rel(params[n], p.detach()) for n, p in ref.named_parameters()), idle


@pytest.mark.parametrize("impl,sequence_parallel", [("eager", False), ("eager", True), ("grouped_mm", False)])
def test_whole_experts_when_a_rank_gets_no_token(impl, sequence_parallel):
    """A rank whose experts get no token still runs the input-gradient collectives its peer runs
    (transformers' eager kernel returns zeros unconnected to the inputs; Note [whole experts per
    rank]): before that, gloo aborted on the mismatched collectives."""
    results = run_distributed(_idle_experts, 2, args=(impl, sequence_parallel), timeout_s=300)
    assert sorted(idle for *_, idle in results) == [False, True]  # the premise: exactly one rank idle
    for losses, param_error, _ in results:
        assert losses[True] == pytest.approx(losses[False], rel=RTOL)
        assert param_error < RTOL


def _jitter(rank, ws, share):
    """Mixtral's router jitter draws over the replicated hidden states in training: with a seed
    per rank, the TP ranks must still draw alike (Note [one random stream per tensor-parallel
    group]); share=False skips parallelize's sharing, to show what it prevents."""
    from parallel_layers.tensor_parallel import plan as plan_module

    torch.manual_seed(0)
    ref = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5))
    par = copy.deepcopy(ref)
    torch.manual_seed(100 + rank)  # each rank its own stream, as many scripts seed
    if not share:
        plan_module.share_random_state = lambda *args: None
    parallelize(par, tp_group=dist.group.WORLD)
    state = torch.get_rng_state()
    results = {}
    for name, model, start in (("ref", ref, torch.manual_seed(100).get_state()), ("par", par, state)):
        torch.set_rng_state(start)
        model.train()
        results[name] = _sgd_losses(model, steps=3, lr=0.5)
    params = _full_params(par, dist.group.WORLD)
    router = par.model.layers[0].mlp.gate.weight.detach().clone()
    gathered = [torch.empty_like(router) for _ in range(ws)]
    dist.all_gather(gathered, router)
    return results, max(_rel(params[n], p.detach()) for n, p in ref.named_parameters()), \
        max(_rel(r, gathered[0]) for r in gathered)


def _jitter_under_sequence_parallelism(rank, ws):
    """With attention dropout the decoder layers draw in each rank's stream under sequence
    parallelism (Note [draws under sequence parallelism]); the MoE block, whose router jitters
    the gathered, replicated tokens, must draw from the shared one: the router's input (the
    jittered tokens) alike on every rank."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
        attention_dropout=0.5))
    torch.manual_seed(100 + rank)
    parallelize(model, tp_group=dist.group.WORLD, sequence_parallel=True)
    hooked = sorted(n for n, m in model.named_modules() if hasattr(m, "_pl_region_streams"))
    logits = []  # the router's, over the gathered tokens: alike on every rank if the jitter was
    model.model.layers[1].mlp.gate.register_forward_hook(lambda m, args, out: logits.append(args[0].detach().clone()))
    _sgd_losses(model.train(), steps=2, lr=0.5)
    spread = 0.0
    for x in logits:
        gathered = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(gathered, x)
        spread = max(spread, max(_rel(g, gathered[0]) for g in gathered))
    return hooked, len(logits), spread


def test_a_routers_jitter_stays_shared_under_sequence_parallelism():
    for hooked, calls, spread in run_distributed(_jitter_under_sequence_parallelism, 2, timeout_s=300):
        assert hooked == [f"model.layers.{i}{m}" for i in (0, 1) for m in ("", ".mlp", ".self_attn")], hooked
        assert calls == 2 and spread == 0.0


def test_tensor_parallel_ranks_draw_the_same_random_numbers():
    for losses, param_error, router_spread in run_distributed(_jitter, 2, args=(True,), timeout_s=300):
        assert losses["par"] == pytest.approx(losses["ref"], rel=RTOL)
        assert param_error < RTOL and router_spread == 0.0
    # without the sharing, the ranks route differently and their replicated routers drift apart
    spreads = [spread for *_, spread in run_distributed(_jitter, 2, args=(False,), timeout_s=300)]
    assert max(spreads) > 1e-5, spreads
