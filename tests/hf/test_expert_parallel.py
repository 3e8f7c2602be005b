"""Expert parallelism (parallel_layers/expert_parallel.py): the experts of Hugging Face mixtures
of experts spread over the data-parallel ranks, tokens dispatched by all-to-all, against the
plain model loaded with `from_pretrained` from the same directory and trained on the whole
batch in one process: every step's loss and gradient norm (clip_grad_norm_, which sums the
experts' squares over dp), and every parameter after 3 SGD steps, read back from
`hf.save_pretrained` of the parallel layout by plain transformers (so the export gathers each
rank's experts into the stacked tensors and writes them one tensor per expert).

Layouts: Mixtral at dp2 with DataParallel (the experts neither broadcast nor averaged) and at
dp4 with ZeRO-3 and selective activation checkpointing (one expert per rank, built on the meta
device and filled by hf.load_pretrained, each rank reading only its expert's tensors);
Qwen3-MoE at dp2 with ZeRO-1 and a checkpoint saved under expert parallelism loaded into a plain
ZeRO-3 layout; Qwen2-MoE (a shared expert beside the routed ones, a dense layer) at pp2 x dp2
with ZeRO-1 over the pipeline stages; with tensor parallelism (each expert split over tp as its
MLP, then the experts over dp): Mixtral at tp2 x dp2 with ZeRO-3 from the meta device, Qwen3-MoE
at tp2 x dp2 with sequence parallelism; a Mixtral whose routers send every token of the first
step to one rank's experts (the same two experts for every token: equal scores), so the other
rank's experts receive nothing and its backward must still join the all-to-alls.

Over part of dp (expert_parallel=2 at dp=4: the experts spread over pairs of data-parallel ranks
and replicated over the two pairs, Note [expert replicas]): Mixtral with DataParallel (the experts
broadcast and averaged over their replica group), Qwen3-MoE with ZeRO-2 (the experts' groups
reduce-scattered over the replica group during backward, in an order of their own), Mixtral with
ZeRO-3 from the meta device with selective checkpointing, its checkpoint loaded into plain ZeRO-3.
"""

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB, LR = 3, 8, 12, 96, 0.5

# name -> the layout: family, dp, and what differs from tp=1, pp=1, DataParallel, from_pretrained,
# no activation checkpointing, no sequence parallelism
CASES = {
    "mixtral-dp2-dataparallel": dict(family="mixtral", dp=2),
    # selective checkpointing of the decoder layers around the experts, whose ZeRO groups have no
    # gather hooks (they would run again in the recompute)
    "mixtral-dp4-zero3-meta-selective": dict(family="mixtral", dp=4, zero=3, build="meta", checkpointing="selective"),
    "qwen3_moe-dp2-zero1-checkpoint": dict(family="qwen3_moe", dp=2, zero=1),
    "qwen2_moe-pp2-dp2-zero1": dict(family="qwen2_moe", dp=2, pp=2, zero=1),
    "mixtral-dp2-idle-rank": dict(family="mixtral-idle", dp=2, optimizer="decay"),
    # only the experts trained: the idle rank's output joins the backward through its weights alone
    "mixtral-dp2-idle-rank-only-experts": dict(family="mixtral-idle", dp=2, optimizer="decay", only_experts=True),
    # each expert split over tp as its MLP (the published plan's Experts()), the experts over dp
    "mixtral-tp2-dp2-zero3-meta": dict(family="mixtral", dp=2, tp=2, zero=3, build="meta"),
    "qwen3_moe-tp2-dp2-sequence-parallel": dict(family="qwen3_moe", dp=2, tp=2, sequence_parallel=True),
    # the experts over pairs of the dp ranks, replicated over the pairs
    "mixtral-dp4-ep2-dataparallel": dict(family="mixtral", dp=4, ep=2),
    "qwen3_moe-dp4-ep2-zero2": dict(family="qwen3_moe", dp=4, ep=2, zero=2),
    "mixtral-dp4-ep2-zero3-meta-selective-checkpoint": dict(family="mixtral", dp=4, ep=2, zero=3, build="meta",
                                                            checkpointing="selective"),
    "qwen2_moe-pp2-dp4-ep2-zero1": dict(family="qwen2_moe", dp=4, ep=2, pp=2, zero=1),
    "mixtral-tp2-dp4-ep2-zero2": dict(family="mixtral", dp=4, ep=2, tp=2, zero=2),
    # routed by token id, so that one replica's second expert rank gets no token and the other's
    # does: its experts' gradients come at different moments (or not at all) on the two replicas
    "mixtral-split-dp4-ep2-zero2": dict(family="mixtral-split", dp=4, ep=2, zero=2),
    "mixtral-split-dp4-ep2-dataparallel-debug": dict(family="mixtral-split", dp=4, ep=2, debug=True, optimizer="decay"),
}
LAYOUT = dict(tp=1, pp=1, ep=None, zero=0, build="from_pretrained", checkpointing=None, sequence_parallel=False,
              debug=False, optimizer="sgd", only_experts=False)


def _save_qwen2_moe(directory):
    config = transformers.Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(directory)


def _save_mixtral_split(directory):
    """A Mixtral whose routers send each token by its id: ids below VOCAB / 2 to experts 0 and 1,
    the others to experts 2 and 3 (embedding feature 0 is +30 or -30 by id, the only one the
    routers read, with weight +1 for experts 0 and 1, -1 for 2 and 3)."""
    _tiny.save_tiny_mixtral(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        low = torch.arange(model.config.vocab_size) < VOCAB // 2
        model.model.embed_tokens.weight[:, 0] = torch.where(low, 30.0, -30.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:2, 0], layer.mlp.gate.weight[2:, 0] = 1.0, -1.0
    model.save_pretrained(directory)


def _save(family, directory):
    if family == "qwen2_moe":
        _save_qwen2_moe(directory)
    elif family == "mixtral-split":
        _save_mixtral_split(directory)
    else:
        getattr(_tiny, f"save_tiny_{family.removesuffix('-idle')}")(directory)


def _batches(family):
    batches = _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB)
    if family == "mixtral-split":  # the first half of the rows (dp ranks 0 and 1 at dp=4) low ids only
        for ids in batches:
            ids[:BATCH // 2] %= VOCAB // 2
    return batches


def _probe():
    return _tiny.probe_ids(SEQ, VOCAB)


_loss = _tiny.next_token_loss


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _decaying_sgd(params):
    """Decays every parameter with a gradient, a zero one included: a rank's experts that no token
    reached must still get one (the plain model's stacked experts do: zero rows). SGD, not Adam,
    whose normalised step turns the last bits of a near-zero gradient into whole steps."""
    return torch.optim.SGD(params, lr=LR, weight_decay=0.1)


_OPTIMIZERS = {"sgd": _sgd, "decay": _decaying_sgd}


def _zero_routers(model):
    """Every router's logits 0: top-2 of equal scores picks experts 0 and 1 for every token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()


def _load(directory, family, only_experts=False):
    model = _load_family(directory, family)
    if only_experts:  # nothing before the experts needs a gradient: their input rows neither
        for name, p in model.named_parameters():
            p.requires_grad_(".experts." in name)
    return model


def _load_family(directory, family):
    if not family.endswith(("-idle", "-split")):
        return transformers.AutoModelForCausalLM.from_pretrained(directory)
    # transformers' eager expert loop leaves an expert no token reached out of autograd (no
    # gradient), and returns zeros unconnected to its input when no expert is hit
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager")
    if family.endswith("-idle"):
        _zero_routers(model)
    return model


def _train(rank, world, directory, export, checkpoint_dir, layout):
    from parallel_layers import checkpoint, expert_parallel, hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss_sum, causal_lm_tokens
    from parallel_layers.zero._group import ParamGroup
    from parallel_layers.zero._hooks import ZeROHooks

    family, dp, pp, tp, build = layout["family"], layout["dp"], layout["pp"], layout["tp"], layout["build"]
    if layout["debug"]:  # every collective of the library checked for agreement first (fault.check_agreement)
        os.environ["PARALLEL_LAYERS_DEBUG"] = "1"
    ctx = init_parallel(dp=dp, pp=pp, tp=tp, device="cpu")
    received = []  # rows this rank's experts received, per all-to-all of tokens
    dispatch = expert_parallel._all_to_all

    def counting(x, recv, send, group):
        received.append(sum(recv))
        return dispatch(x, recv, send, group)

    expert_parallel._all_to_all = counting
    # ZeRO-3 reduce-scatters a group once its backward is done; one rank's experts (a group of
    # that rank alone) must not hold the others back to the end of backward (Note [expert groups])
    in_backward = []
    launch = ZeROHooks._launch_reduce

    def launch_reduce(hooks, g):
        in_backward.append((g.name, hooks.callback_queued))  # False once the end-of-backward callback runs
        return launch(hooks, g)

    ZeROHooks._launch_reduce = launch_reduce
    # experts over replicas of several ranks are reduced at the end of backward (Note [expert groups])
    ending, at_end = [False], []
    finalize, reduce_grads = ZeROHooks._finalize_backward, ParamGroup.reduce_grads

    def finalize_backward(hooks):
        ending[0] = True
        try:
            return finalize(hooks)
        finally:
            ending[0] = False

    def recording_reduce_grads(g, *args, **kwargs):
        at_end.append((g.name, ending[0]))
        return reduce_grads(g, *args, **kwargs)

    ZeROHooks._finalize_backward, ParamGroup.reduce_grads = finalize_backward, recording_reduce_grads
    if build == "meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    else:
        model = _load(directory, family, layout["only_experts"])
    piped = pp > 1
    kwargs = dict(loss_fn=causal_lm_loss_sum, token_count=causal_lm_tokens, pipeline_layers="auto",
                  microbatches=2) if piped else dict(loss_fn=_loss)
    optimizer = _OPTIMIZERS[layout["optimizer"]]
    par = parallelize(model, ctx, optimizer=optimizer, zero_stage=layout["zero"], expert_parallel=layout["ep"] or True,
                      tp_plan="auto" if tp > 1 else None, sequence_parallel=layout["sequence_parallel"],
                      activation_checkpointing=layout["checkpointing"], **kwargs)
    if build == "meta":
        hf.load_pretrained(directory, par)
    experts = [m for m in model.modules() if expert_parallel.is_expert_parallel_module(m)]
    shapes = {tuple(m.gate_up_proj.shape) for m in experts if not m.gate_up_proj.is_meta}
    offsets = sorted({m.expert_parallel_offset for m in experts})
    first = received[:]
    losses, norms = [], []
    for step, ids in enumerate(_batches(family)):
        mine = ids.chunk(dp)[ctx.coordinate("dp")]  # equal token counts: the mean of means is the batch mean
        if step == 0:
            del received[:]
        loss = par.forward_backward(mine, mine)
        if step == 0:
            first = received[:]
        norms.append(par.clip_grad_norm_(1e9).item())
        par.step()
        par.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=ctx.dp_group)
        losses.append(mean.item() / dp)
    hf.save_pretrained(par.module, export)
    # the experts' groups are reduced once a step: no pooled ZeRO-3 buffers held between steps
    pooled = [g.name for g in getattr(getattr(par.module, "_hooks", None), "experts", []) if g.pool is not None]
    full = {}
    if layout["zero"] and pp == 1:  # ZeRO's own full state dict gathers every rank's experts
        full = {k: v.tolist() for k, v in par.module.full_state_dict().items() if k.endswith("mlp.experts.down_proj")}
    # every rank created the same groups (the expert-parallel ones included): a new one still works
    everyone = torch.ones(1)
    torch.distributed.all_reduce(everyone, group=torch.distributed.new_group(list(range(world))))
    resumed_diff = None
    if checkpoint_dir is not None:  # saved with expert parallelism, loaded into plain ZeRO-3 over dp
        path = checkpoint.save(checkpoint_dir, STEPS, par.module, par.optimizer, prefix=par.prefix)
        with torch.no_grad():
            want = par.module(_probe()).logits
        plain = parallelize(_load(directory, family), ctx, optimizer=_sgd, loss_fn=_loss, zero_stage=3)
        checkpoint.load(path, plain.module, plain.optimizer, prefix=plain.prefix)
        with torch.no_grad():
            resumed_diff = (plain.module(_probe()).logits - want).abs().max().item()
    expert_parallel._all_to_all, ZeROHooks._launch_reduce = dispatch, launch
    ZeROHooks._finalize_backward, ParamGroup.reduce_grads = finalize, reduce_grads
    return dict(losses=losses, norms=norms, shapes=sorted(shapes), offsets=offsets, first_step_rows=first,
                full=full, pooled=pooled, everyone=everyone.item(), reduced_in_backward=in_backward,
                experts_reduced_at_end=[flag for name, flag in at_end if name.endswith(".experts")],
                resumed_diff=resumed_diff, dp_rank=ctx.coordinate("dp"), pp_rank=ctx.coordinate("pp"))


def _reference(directory, family, optimizer="sgd", only_experts=False):
    model = _load(directory, family, only_experts)
    opt = _OPTIMIZERS[optimizer](model.parameters())
    losses, norms = [], []
    for ids in _batches(family):
        loss = _loss(model(ids), ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


@pytest.mark.parametrize("case", CASES)
def test_experts_over_data_parallel_ranks_train_like_the_plain_model(tmp_path, case):
    layout = {**LAYOUT, **CASES[case]}
    family, dp, tp = layout["family"], layout["dp"], layout["tp"]
    ep = layout["ep"] or dp
    directory, export = str(tmp_path / "model"), str(tmp_path / "export")
    _save(family, directory)
    ref_losses, ref_norms, ref_state = _reference(directory, family, layout["optimizer"], layout["only_experts"])
    checkpoint_dir = str(tmp_path / "checkpoint") if case.endswith("-checkpoint") else None
    results = run_distributed(_train, dp * layout["pp"] * tp, args=(directory, export, checkpoint_dir, layout),
                              timeout_s=240, collective_timeout_s=60)
    config = transformers.AutoConfig.from_pretrained(directory)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    width = 2 * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size) // tp
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (rank, r["losses"], ref_losses)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-4), (rank, r["norms"], ref_norms)
        # each rank holds its E / ep experts of every MoE layer it holds (Qwen2-MoE's second stage
        # holds its dense layer only), those of its place in its group of ep consecutive dp ranks;
        # under tp each expert's gate and up rows are split too
        holds = family != "qwen2_moe" or r["pp_rank"] == 0
        assert bool(r["shapes"]) == holds and all(s[:2] == (experts // ep, width) for s in r["shapes"]), \
            (rank, r["shapes"])
        assert r["offsets"] == [r["dp_rank"] % ep * experts // ep], (rank, r["offsets"])
        if r["resumed_diff"] is not None:
            assert r["resumed_diff"] < 1e-5, (rank, r["resumed_diff"])
        assert r["everyone"] == dp * layout["pp"] * tp
        assert r["pooled"] == [], (rank, r["pooled"])
        for name, value in r["full"].items():  # every expert, not this rank's (tp-local under tp)
            want = ref_state[name].chunk(tp, dim=2)[rank % tp]
            torch.testing.assert_close(torch.tensor(value), want, rtol=1e-4, atol=1e-5)
        if layout["zero"] == 3 and layout["pp"] == 1:
            assert any(flag for _, flag in r["reduced_in_backward"]), (rank, r["reduced_in_backward"])
        if ep < dp and layout["zero"] >= 2:  # the experts' groups over their replicas: at the end of backward
            assert r["experts_reduced_at_end"] and all(r["experts_reduced_at_end"]), (rank, r["experts_reduced_at_end"])
    if family.endswith("-split"):  # the premise: one replica's second expert rank gets no row, the other's do
        firsts = {r["dp_rank"]: r["first_step_rows"][0] for r in results}
        assert firsts[1] == 0 and firsts[3] > 0, firsts
    if family.endswith("-idle"):  # the premise: in the first step's first dispatch one rank's experts get no row
        firsts = sorted(r["first_step_rows"][0] for r in results)
        assert firsts == [0, 2 * BATCH * SEQ], firsts  # top-2 of each token of both ranks, all to one rank
    exported = transformers.AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert exported.keys() == ref_state.keys()
    for name, want in ref_state.items():
        torch.testing.assert_close(exported[name], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _refusals(rank, world, directory):
    from parallel_layers import init_parallel, parallelize

    ctx = init_parallel(dp=world, device="cpu")
    messages = []
    mixtral = _load(directory, "mixtral")
    import peft

    adapted = peft.get_peft_model(_load(directory, "mixtral"), peft.LoraConfig(r=2, target_modules="all-linear"))
    for model, flag in ((_tiny_llama(), True), (mixtral, 1.5), (mixtral, 2), (mixtral, 3), (mixtral, True),
                        (adapted, True)):
        try:
            parallelize(model, ctx, optimizer=_sgd, loss_fn=_loss, expert_parallel=flag)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    return messages


def _tiny_llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(config)


def test_expert_parallel_refusals_name_the_values(tmp_path):
    from parallel_layers import expert_parallel

    _tiny.save_tiny_mixtral(tmp_path)
    messages = run_distributed(_refusals, 3, args=(str(tmp_path),))
    assert messages[0] == messages[1] == messages[2]  # every rank raises
    no_experts, not_a_degree, not_dividing_dp, experts_indivisible, indivisible, lora = messages[0]
    assert no_experts.startswith("parallelize: expert_parallel=True found no mixture-of-experts module in "
                                 "LlamaForCausalLM")
    assert not_a_degree == ("expert_parallel must be True (the experts over all dp=3 ranks), False, or the number of "
                            "data-parallel ranks to spread them over (a divisor of dp: [1, 3]), got 1.5")
    assert not_dividing_dp == ("expert_parallel=2 must divide dp=3 (the experts are spread over groups of that many "
                               "data-parallel ranks and replicated over dp / expert_parallel of them); valid values at "
                               "dp=3: [1, 3] (or True, False)")
    assert experts_indivisible == (
        "parallelize: expert_parallel=3 over ep=3 data-parallel ranks cannot split model.layers.0.mlp.experts: "
        "MixtralExperts has 4 experts (num_experts = 4); Experts(split='experts') needs num_experts to match and to "
        "divide by ep=3; valid expert-parallel (data-parallel) sizes for it are [1, 2, 4]")
    assert indivisible == (
        "parallelize: expert_parallel=True over dp=3 ranks cannot split model.layers.0.mlp.experts: MixtralExperts "
        "has 4 experts (num_experts = 4); Experts(split='experts') needs num_experts to match and to divide by dp=3; "
        "valid expert-parallel (data-parallel) sizes for it are [1, 2, 4]")
    # peft's LoRA on "all-linear" adapts the stacked expert weights (a ParamWrapper): it failed inside peft
    # ("The expanded size of the tensor (4) must match the existing size (2)") at the first forward
    assert lora.startswith(
        "parallelize: expert_parallel=True cannot split base_model.model.model.layers.0.mlp.experts.base_layer."
        "base_layer: peft adapts its stacked expert weights (base_model.model.model.layers.0.mlp.experts.base_layer "
        "is a ParamWrapper, whose LoRA factors cover every expert), and expert parallelism keeps some experts per "
        "rank. Train this LoRA model with expert_parallel=False"), lora
    # under tensor parallelism each expert must be split as its MLP (Experts()), not whole experts
    from parallel_layers.tensor_parallel import Experts, parallelize, published_plan

    model = _load(str(tmp_path), "mixtral")
    with pytest.raises(ValueError, match=r"expert_parallel=True at tp > 1 splits each expert of "
                                         r"model.layers.0.mlp.experts over the tensor-parallel ranks as its MLP .*; "
                                         r"the plan left them not split \(no Experts\(\) entry in the plan\)"):
        expert_parallel.check_tensor_parallel(model, ["model.layers.0.mlp.experts"])
    parallelize(model, {**published_plan(model), "model.layers.*.mlp.experts": Experts(split="experts")})
    with pytest.raises(ValueError, match=r"the plan left them whole experts per tensor-parallel rank"):
        expert_parallel.check_tensor_parallel(model, ["model.layers.0.mlp.experts"])


@pytest.mark.parametrize("rank, ep, spread, replicas", [
    (5, 2, [5, 7], [1, 5]),  # (pp 0, dp 2, tp 1): dp ranks {2, 3} hold the experts, dp {0, 2} the same ones
    (14, 2, [12, 14], [10, 14]),  # (pp 1, dp 3, tp 0)
    (5, 4, [1, 3, 5, 7], [5]),  # over all of dp: no replica but itself
    (14, 1, [14], [8, 10, 12, 14]),
])
def test_expert_groups_are_consecutive_dp_ranks_and_their_replicas(rank, ep, spread, replicas):
    """expert_groups on a (pp=2, dp=4, tp=2) mesh of 16 ranks (the fake process group): the
    expert-parallel group is `ep` consecutive dp ranks at this rank's pp and tp coordinates, the
    replica group the dp / ep ranks at the same place in theirs (Note [expert replicas])."""
    import types

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel_layers.expert_parallel import expert_groups

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=16)
    try:
        groups = expert_groups(types.SimpleNamespace(mesh=torch.arange(16).reshape(2, 4, 2)), ep)
        assert [dist.get_process_group_ranks(g) for g in groups] == [spread, replicas]
    finally:
        dist.destroy_process_group()
