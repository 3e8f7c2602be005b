"""Sequence parallelism on Hugging Face decoders ([batch, seq, hidden]): plan-free
`tensor_parallel.parallelize(model, tp_group=..., sequence_parallel=True)` at tp=2 on Llama,
Qwen2, Mistral, GPT-2, Qwen3, Gemma, Gemma 2, Gemma 3, OLMo, Nemotron, SmolLM3, EXAONE 4, Mixtral and Qwen3-MoE
(their MoE blocks gather the sequence and reduce-scatter their output; Mixtral also with whole
experts per rank), GLM, GLM-4, Phi-3, OLMo 2 and OLMoE (regions whose plans gather their column
layers' outputs) and Qwen2-MoE (a shared expert kept whole) loaded with from_pretrained gives the
plain transformers model's logits, loss, every parameter's gradient and its parameters after 3
optimizer steps; the decoder layers' norms really see seq / tp positions per rank (this rank's
chunk), OLMo 2's and OLMoE's q_norm / k_norm the whole sequence and every head; a forward
issues no all-reduce (the vocabulary-parallel embedding's partial sums are reduce-scattered at
decoder layer 0, the row layers reduce-scatter), and each family's forward all-gathers and its
backward's collectives are counted; a sequence length tp does not divide is refused on every
rank; the composing parallelize passes the option through (with and without activation
checkpointing of the decoder layers, whose recompute re-runs the sequence collectives) and
refuses it with a pipeline."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_layers.tensor_parallel import VocabParallelEmbedding, gather_full, parallelize
from tests.dist_harness import run_distributed
from tests.tensor_parallel.test_layers import _count_collectives
from tests.tensor_parallel.test_parallelize import _build

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "qwen2", "mistral", "gpt2", "qwen3", "gemma", "olmo", "nemotron", "smollm3", "exaone4", "mixtral",
         "qwen3_moe", "mixtral_whole_experts", "glm", "glm4", "phi3", "olmo2", "olmoe", "qwen2_moe", "gemma2", "gemma3")
TIED = ("gpt2", "gemma", "smollm3", "gemma2", "gemma3")  # their heads are tied to the embedding: both stay replicated
# Column layers per decoder layer that gather their outputs (Note [gathered regions under
# sequence parallelism]): Phi-3's qkv_proj, OLMo 2's and OLMoE's q, k and v; and of them, row
# layers that split their whole input again. Not the packed gate_up_proj of GLM, GLM-4 and
# Phi-3, which their published plans gather: it is split block by block instead (Note [packed
# MLPs split block by block] in tensor_parallel/plan.py), its MLP a region like any other.
GATHERED = {"phi3": 1, "olmo2": 3, "olmoe": 3}
SPLIT_INPUT_ROWS = {"phi3": 1, "olmo2": 1, "olmoe": 1}
# Note [re-gathering the sequence in backward]: the column layers that read a region's gathered
# input keep this rank's chunk and the first of them to run its backward gathers it again, for
# them all: one all-gather per region in the 2 layers - attention's and the MLP's (2 a layer); a
# mixture's attention only (its experts gather their own), Qwen2-MoE's dense layer 1 its MLP too
# (1 + 2). Not the heads: they read a slice of the final norm's output (logits_to_keep), not the
# gather's own tensor.
REGATHERED = {"mixtral": 2, "qwen3_moe": 2, "mixtral_whole_experts": 2, "olmoe": 2, "qwen2_moe": 3}
# + post_self_attn_layernorm, post_mlp_layernorm (GLM-4), pre_ and post_feedforward_layernorm
# (Gemma 2, 3); the others 2
NORMS_PER_LAYER = {"glm4": 4, "gemma2": 4, "gemma3": 4}
# Parameters whose gradients are summed over tp (one all-reduce each in backward): the norms'
# weights (and biases) of the 2 layers and the final norm - none in OLMo's parameter-free
# LayerNorms; GPT-2's and Nemotron's have biases, GLM-4 4 norms a layer - GPT-2's row biases,
# Qwen3's and EXAONE 4's per-head q_norm / k_norm, the MoE routers (Qwen2-MoE's layer 1 is dense)
# and Qwen2-MoE's shared expert gate; not OLMo 2's q_norm / k_norm or OLMoE's, which see every head
# (Note [gathered regions under sequence parallelism]), nor Qwen2-MoE's shared expert, whole (Note
# [a shared expert under sequence parallelism]).
SUMMED = {"llama": 5, "qwen2": 5, "mistral": 5, "gpt2": 14, "qwen3": 9, "gemma": 5, "olmo": 0, "nemotron": 10,
          "smollm3": 5, "exaone4": 9, "mixtral": 7, "qwen3_moe": 11, "mixtral_whole_experts": 7, "glm": 5, "glm4": 9,
          "phi3": 5, "olmo2": 5, "olmoe": 7, "qwen2_moe": 7, "gemma2": 9, "gemma3": 13}
# OLMo 2's and OLMoE's q_norm / k_norm: over every head's features, after gathered q and k: the
# whole sequence
WHOLE_QK_NORMS = ("olmo2", "olmoe")
TP, BATCH, SEQ, STEPS, VOCAB = 2, 2, 16, 3, 96  # _build's models: vocabulary 96, 32 positions
# float32; the reduce-scatters and the summed norm gradients add in another order than one
# process does. The parity tolerance.
RTOL = 1e-4


def _rel(a, b, scale=None):
    scale = b.abs().max() if scale is None else scale
    return ((a - b).abs().max() / scale.clamp_min(1e-30)).item()


def _module_scales(ref, grads):
    """Per parameter, the largest magnitude among its module's reference tensors (gradients or
    values). Errors are relative to that: the key bias's true gradient is exactly zero
    (softmax ignores it), so both models' are rounding noise (and so is the zero-initialised
    bias they step), which differ once SP sums in another order; measured against its
    projection's weight the noise is at rounding level, and any real error is not."""
    owners = {}
    for name, p in ref.named_parameters():
        t = p.grad if grads else p.detach()
        owner = name.rpartition(".")[0]
        owners[owner] = torch.maximum(owners.get(owner, torch.zeros(())), t.abs().max())
    return {name: owners[name.rpartition(".")[0]] for name, _ in ref.named_parameters()}


def _norm_inputs(model, layout_names, store):
    """Record the input of every norm of the decoder layers and of the final norm (first call only):
    for a fused post-attention norm called as norm(h, residual), the sum it normalises."""
    def record(name):
        def hook(module, args):  # returns None: the input is left as it is
            store.setdefault(name, (args[0] + args[1] if len(args) == 2 else args[0]).detach())
        return hook

    for name, module in model.named_modules():
        inside = any(name.startswith(layer + ".") for layer in layout_names[0]) or name == layout_names[1]
        if inside and "Norm" in type(module).__name__:
            module.register_forward_pre_hook(record(name))


def _as_ref(name, tensor, ref_modules):
    """Our [out, in] weight in the layout of the reference's parameter (GPT-2's Conv1D is [in, out])."""
    owner = ref_modules[name.rpartition(".")[0]]
    return tensor.t() if type(owner).__name__ == "Conv1D" and name.endswith("weight") else tensor


def _full(p, grad, group):
    t = p.grad if grad else p.detach()
    return gather_full(t, group, p.tp_shard) if hasattr(p, "tp_shard") else t.detach()


def _parity(rank, ws, directories):
    from parallel_layers.tensor_parallel.hf_sequence_parallel import find_layout

    group = dist.group.WORLD
    results = {}
    for kind, directory in directories.items():
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
        par = transformers.AutoModelForCausalLM.from_pretrained(directory)
        plan = None
        if kind.endswith("_whole_experts"):  # each rank whole experts (Note [whole experts per rank])
            from parallel_layers.tensor_parallel import Experts, published_plan
            plan = {**published_plan(par), "model.layers.*.mlp.experts": Experts(split="experts")}
        parallelize(par, plan, tp_group=group, sequence_parallel=True)
        ref.train()
        par.train()
        layout = find_layout(ref)
        seen_ref, seen_par = {}, {}
        _norm_inputs(ref, (layout.layers, layout.final_norm), seen_ref)
        _norm_inputs(par, (layout.layers, layout.final_norm), seen_par)
        # SGD, as in test_parallelize.py: Adam would blow the rounding noise of the key bias's
        # exactly-zero gradient (Qwen2) up to lr-sized steps.
        opt_ref, opt_par = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(par.parameters(), lr=0.1)
        ref_params, ref_modules = dict(ref.named_parameters()), dict(ref.named_modules())
        g = torch.Generator().manual_seed(1)
        worst = {}

        def note(key, value):
            worst[key] = max(worst.get(key, 0.0), value)

        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            out_ref, out_par = ref(input_ids=ids, labels=ids), par(input_ids=ids, labels=ids)
            note("logits", _rel(out_par.logits.detach(), out_ref.logits.detach()))
            note("loss", abs(out_par.loss.item() - out_ref.loss.item()) / out_ref.loss.item())
            out_ref.loss.backward()
            out_par.loss.backward()
            scales = _module_scales(ref, grads=True)
            for name, p in par.named_parameters():
                note(f"grad {name}", _rel(_as_ref(name, _full(p, True, group), ref_modules), ref_params[name].grad,
                                          scales[name]))
            opt_ref.step()
            opt_par.step()
            opt_ref.zero_grad()
            opt_par.zero_grad()
        scales = _module_scales(ref, grads=False)
        for name, p in par.named_parameters():
            note(f"param {name}", _rel(_as_ref(name, _full(p, False, group), ref_modules), ref_params[name].detach(),
                                       scales[name]))
        # This rank's norms saw its own chunk of the sequence (first step), and only that; the norms
        # inside attention (q_norm, k_norm) the gathered sequence: Qwen3's and EXAONE 4's this rank's
        # heads, OLMo 2's every head, as the plain model's.
        in_attention = ("q_norm", "k_norm")
        chunks = {name: (tuple(x.shape), _rel(x, seen_ref[name].chunk(ws, 1)[rank])) for name, x in seen_par.items()
                  if not name.endswith(in_attention)}
        whole = {name: (tuple(x.shape) == tuple(seen_ref[name].shape), _rel(x, seen_ref[name]))
                 for name, x in seen_par.items() if name.endswith(in_attention) and kind in WHOLE_QK_NORMS}
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        with torch.no_grad(), _count_collectives() as counts:  # one forward's collectives
            par(input_ids=ids)
        out = par(input_ids=ids, labels=ids)
        with _count_collectives() as backward:  # and one backward's
            out.loss.backward()
        par.zero_grad()
        vocab_parallel = isinstance(par.get_input_embeddings(), VocabParallelEmbedding)
        try:  # 15 positions at tp=2, with gradients
            par(input_ids=torch.randint(0, VOCAB, (BATCH, SEQ - 1), generator=g))
            message = None
        except ValueError as e:
            message = str(e)
        # without gradients (evaluate, generate()) any length runs, as plain tensor parallelism
        # (Note [a forward without the sequence split]): the plain model's logits
        ref.eval()
        par.eval()
        with torch.no_grad():
            for odd in (SEQ - 1, 1):
                ids = torch.randint(0, VOCAB, (BATCH, odd), generator=g)
                note(f"no-grad logits of {odd} positions", _rel(par(input_ids=ids).logits, ref(input_ids=ids).logits))
        par.train()
        results[kind] = (worst, chunks, whole, message, dict(counts), dict(backward), vocab_parallel,
                         len(layout.layers))
    return results


def test_plan_free_sequence_parallel_matches_single_process(tmp_path):
    directories = {}
    for kind in KINDS:
        directories[kind] = str(tmp_path / kind)
        _build(kind.removesuffix("_whole_experts"))[0].save_pretrained(directories[kind])
    for rank, results in enumerate(run_distributed(_parity, TP, args=(directories,), timeout_s=300)):
        assert sorted(results) == sorted(KINDS)
        for kind, (worst, chunks, whole, message, counts, backward, vocab_parallel, layers) in results.items():
            bad = {k: v for k, v in worst.items() if not v < RTOL}
            assert not bad, f"{kind}, rank {rank}: relative errors above {RTOL}: {bad}"
            assert any(k.startswith("grad ") for k in worst) and any(k.startswith("param ") for k in worst)
            assert f"no-grad logits of {SEQ - 1} positions" in worst and "no-grad logits of 1 positions" in worst
            # 2 layers x 2 norms (GLM-4: 4) + the final norm, each fed [batch, seq / tp, hidden]: this
            # rank's chunk
            assert len(chunks) == layers * NORMS_PER_LAYER.get(kind, 2) + 1, (kind, sorted(chunks))
            for name, (shape, err) in chunks.items():
                assert shape == (BATCH, SEQ // TP, 32), (kind, name, shape)
                assert err < RTOL, (kind, name, err)
            # OLMo 2's q_norm / k_norm: the plain model's whole input (every head, the whole sequence)
            assert len(whole) == (2 * layers if kind in WHOLE_QK_NORMS else 0), (kind, sorted(whole))
            assert all(same_shape and err < RTOL for same_shape, err in whole.values()), (kind, whole)
            # Llama, Qwen2, Mistral: the published plan's vocabulary-parallel embedding, its partial
            # sums reduce-scattered at layer 0 (Megatron's), not all-reduced and then split; GPT-2's
            # embedding is tied to its head, so replicated. No all-reduce anywhere in the forward.
            assert vocab_parallel == (kind not in TIED), kind
            assert counts["all_reduce"] == 0, (kind, counts)
            assert counts["reduce_scatter_single"] == 2 * layers + vocab_parallel, (kind, counts)  # + o / down_proj
            # the entry of each region, the gathered column outputs, the final norm's output and the
            # untied column head's logits
            assert counts["all_gather_single"] == (2 + GATHERED.get(kind, 0)) * layers + 1 + (kind not in TIED), \
                (kind, counts)
            # backward: each region's entry reduce-scatters; each row layer all-gathers the sequence (a
            # split-input one its input gradient's features too), and so does layer 0's split, and
            # each column layer its input (REGATHERED); the all-reduces are the gradient sums of the
            # parameters left whole (SUMMED) and the untied column head's input gradient
            assert backward["reduce_scatter_single"] == 2 * layers, (kind, backward)
            assert backward["all_gather_single"] == ((2 + SPLIT_INPUT_ROWS.get(kind, 0)) * layers + 1
                                                     + REGATHERED.get(kind, 2 * layers)), (kind, backward)
            assert backward["all_reduce"] == SUMMED[kind] + (kind not in TIED), (kind, backward)
            layer = "transformer.h.0" if kind == "gpt2" else "model.layers.0"
            assert message == (
                f"sequence parallelism splits the sequence over the tensor-parallel group: the hidden states entering "
                f"{layer} have shape ({BATCH}, {SEQ - 1}, 32) ([batch, seq, hidden]), and a sequence length of "
                f"{SEQ - 1} does not divide by tp={TP}; valid lengths are multiples of {TP} (the nearest: {SEQ - 2} "
                f"or {SEQ}). Pad the batch (labels -100 on the padding) or parallelize with sequence_parallel=False. "
                "(A forward without gradients - evaluate, generate() - takes any length: it runs as plain tensor "
                "parallelism; not under a pipeline, whose stages all read the split.)")


def _causal_lm_loss(out, ids):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _composed(rank, ws, directory):
    from parallel_layers import init_parallel
    from parallel_layers import parallelize as compose

    ctx = init_parallel(tp=ws, device="cpu")
    group = ctx.tp_group
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    ref_params, scales = dict(ref.named_parameters()), _module_scales(ref, grads=True)
    results = {}
    # with activation checkpointing of the decoder layers too: the recompute re-runs the
    # region gathers and reduce-scatters (Note [recompute collectives])
    for mode in (None, "full", "selective"):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        par = compose(model, ctx, optimizer=sgd, loss_fn=_causal_lm_loss, tp_plan="auto", sequence_parallel=True,
                      activation_checkpointing=mode, wrap=lambda m: type(m).__name__ == "LlamaDecoderLayer")
        norm_shapes = []
        model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda m, a: norm_shapes.append(a[0].shape))
        loss = par.forward_backward(ids, ids).item()
        worst = max(_rel(_full(p, True, group), ref_params[name].grad, scales[name])
                    for name, p in model.named_parameters())
        results[mode] = (abs(loss - want.item()) / want.item(), worst, norm_shapes)
    # gradient accumulation over 2 microbatches (the pipeline runtime at pp=1): each microbatch's
    # sequence split as the whole batch's (Note [sequence parallelism across stages])
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    from parallel_layers.pipeline.hf import causal_lm_loss  # the pipeline's last layer returns the logits

    par = compose(model, ctx, optimizer=sgd, loss_fn=causal_lm_loss, tp_plan="auto", sequence_parallel=True,
                  pipeline_layers="auto", microbatches=2)
    norm_shapes = []
    model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda m, a: norm_shapes.append(a[0].shape))
    loss = par.forward_backward(ids, ids).item()
    worst = max(_rel(_full(p, True, group), ref_params[name].grad, scales[name]) for name, p in model.named_parameters())
    results["microbatches=2"] = (abs(loss - want.item()) / want.item(), worst, norm_shapes)
    try:  # without gradients, a length tp does not divide ran unsplit on the first stage only: refused
        par.evaluate(ids[:, :SEQ - 1], ids[:, :SEQ - 1])
        odd = None
    except ValueError as e:
        odd = str(e)
    try:
        compose(transformers.AutoModelForCausalLM.from_pretrained(directory), ctx, optimizer=sgd,
                loss_fn=_causal_lm_loss, tp_plan="auto", sequence_parallel=True, pipeline_layers="model.layers",
                microbatches=2)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return results, refusal, odd


def test_composing_parallelize_passes_sequence_parallel_through(tmp_path):
    _build("llama")[0].save_pretrained(tmp_path)
    for results, refusal, odd in run_distributed(_composed, TP, args=(str(tmp_path),), timeout_s=300):
        assert odd is not None and "a sequence length of 15 does not divide by tp=2" in odd and \
            "not under a pipeline, whose stages all read the split" in odd, odd
        assert sorted(results, key=str) == sorted([None, "full", "selective", "microbatches=2"], key=str)
        for mode, (loss_diff, grad_diff, norm_shapes) in results.items():
            assert loss_diff < RTOL and grad_diff < RTOL, (mode, loss_diff, grad_diff)
            rows = BATCH // 2 if mode == "microbatches=2" else BATCH
            assert norm_shapes and all(shape == (rows, SEQ // TP, 32) for shape in norm_shapes), (mode, norm_shapes)
        # a layer list of the user's own: its layers know nothing of the split sequence
        assert refusal == ("parallelize: sequence_parallel=True needs tp_plan= (it splits the sequence between the "
                           "tensor-parallel regions), and with a pipeline (pp > 1 or microbatches > 1) a Hugging Face "
                           "decoder cut by pipeline_layers='auto'; got a tp_plan, pp=1, microbatches=2, "
                           "pipeline_layers='model.layers'")


def test_refusals_before_any_conversion(monkeypatch):
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match=r"sequence_parallel=True supports the Hugging Face decoders whose forward "
                                         r"was checked for it, model_type in \['exaone4', 'gemma', 'gemma2', "
                                         r"'gemma3_text', 'glm', 'glm4', "
                                         r"'gpt2', 'llama', 'mistral', 'mixtral', 'nemotron', 'olmo', 'olmo2', "
                                         r"'olmoe', 'phi3', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'smollm3'\]; "
                                         r"BertForMaskedLM has model_type 'bert'"):
        parallelize(bert, {"bert.encoder.layer.*.intermediate.dense": "column"}, sequence_parallel=True)
    model, _ = _build("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"needs every linear layer of the decoder layers in the tensor-parallel "
                                         r"plan .*; model.layers.0.self_attn.q_proj \(Linear\) is not in it"):
        parallelize(model, {"model.layers.*.mlp.*_proj": "column"}, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"each region \(model.layers.0.mlp\) to hold both its column layers .*; "
                                         r"model.layers.0.mlp has 3 column and 0 row layer\(s\) in the plan"):
        parallelize(model, {"model.layers.*.self_attn.[qkv]_proj": "column", "model.layers.*.self_attn.o_proj": "row",
                            "model.layers.*.mlp.*_proj": "column"}, sequence_parallel=True)
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing was converted
    # OLMo 2's q_norm / k_norm beside a gathered q_proj and a k_proj left split: whether their
    # gradients are whole or partial would depend on the column each reads
    from parallel_layers.tensor_parallel import Column, published_plan
    olmo2, _ = _build("olmo2")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn holds \['model.layers.0.self_attn.q_norm.weight', "
                                         r"'model.layers.0.self_attn.k_norm.weight'\] and gathers the outputs of "
                                         r"\['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj'\] "
                                         r"but not of \['model.layers.0.self_attn.k_proj'\]. Gather all of them or "
                                         r"none"):
        parallelize(olmo2, {**published_plan(olmo2), "model.layers.*.self_attn.k_proj": Column()},
                    sequence_parallel=True)
    assert type(olmo2.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # nothing converted
    with pytest.raises(TypeError, match="sequence_parallel must be True or False, got 'yes'"):
        parallelize(model, sequence_parallel="yes")
    # a MoE block whose output is not the experts' alone (as if Mixtral's added a shared expert's)
    from parallel_layers.tensor_parallel import hf_sequence_parallel
    mixtral, _ = _build("mixtral")
    monkeypatch.setattr(hf_sequence_parallel, "_EXPERTS_BLOCK_RETURNS_EXPERTS", ("qwen3_moe",))
    with pytest.raises(ValueError, match=r"sequence_parallel=True splits the experts of a MoE block whose output is "
                                         r"theirs alone, in model_type \['qwen3_moe'\], or theirs plus a gated shared "
                                         r"expert's, in \['qwen2_moe'\]; model.layers.0.mlp.experts is in "
                                         r"MixtralForCausalLM \(model_type 'mixtral'\)"):
        parallelize(mixtral, sequence_parallel=True)
    assert type(mixtral.model.layers[0].mlp.experts).__name__ == "MixtralExperts"  # nothing converted
    # Qwen2-MoE's shared expert sharded by the plan: under SP it stays whole (Note [a shared expert
    # under sequence parallelism])
    qwen2_moe, _ = _build("qwen2_moe")
    with pytest.raises(ValueError, match=r"sequence_parallel=True keeps a MoE block's shared expert and its gate "
                                         r"whole .*; the plan names \['model.layers.0.mlp.shared_expert.gate_proj'\]"):
        parallelize(qwen2_moe, {**published_plan(qwen2_moe), "model.layers.*.mlp.shared_expert.gate_proj": "column"},
                    sequence_parallel=True)
    assert type(qwen2_moe.model.layers[0].mlp.experts).__name__ == "Qwen2MoeExperts"  # nothing converted
    mixtral.config.output_router_logits = True  # the load-balancing loss: its gradient is whole on every rank
    with pytest.raises(ValueError, match=r"sequence_parallel=True does not support the routers' load-balancing loss "
                                         r"\(MixtralForCausalLM has config.output_router_logits=True\)"):
        parallelize(mixtral, sequence_parallel=True)


def test_sequence_layer_arguments():
    from parallel_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(TypeError, match=r"ColumnParallelLinear: shared_input must be True or False, got 'yes'"):
        ColumnParallelLinear(4, 4, shared_input="yes")
    with pytest.raises(TypeError, match=r"ColumnParallelLinear: seq_dim must be an int \(0 for \[seq, batch, hidden\], "
                                        r"1 for \[batch, seq, hidden\]\), got '1'"):
        ColumnParallelLinear(4, 4, sequence_parallel=True, seq_dim="1")
    with pytest.raises(TypeError, match=r"RowParallelLinear: seq_dim must be an int .*, got None"):
        RowParallelLinear(4, 4, sequence_parallel=True, seq_dim=None)


def _whole_sequence_forwards(rank, ws):
    from parallel_layers.tensor_parallel import comm

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.1, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    parallelize(model, tp_group=dist.group.WORLD, sequence_parallel=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ - 1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.transformer(ids)  # the decoder called by itself, 15 positions
        left_on = comm.whole_sequence()
        model.train()  # dropout on: generate() without eval(), a rollout
        logits = model(ids).logits
    return left_on, logits.tolist()


def test_a_forward_without_the_split_leaves_nothing_behind_and_drops_alike_on_every_rank():
    """helper-50: the decoder called directly (model.transformer / model.model) left the flag of
    Note [a forward without the sequence split] on, for the process's other sequence-parallel
    layers; and a train-mode forward without the split drew each decoder layer's dropout from
    each rank's own stream over the replicated residual stream (0.026 apart between the ranks)."""
    results = run_distributed(_whole_sequence_forwards, TP)
    assert [left_on for left_on, _ in results] == [False] * TP
    first = torch.tensor(results[0][1])
    for _, logits in results[1:]:
        assert torch.equal(torch.tensor(logits), first)
