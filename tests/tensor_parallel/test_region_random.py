"""Note [a random stream per rank inside TP regions]: at tp=2 a GPT-2 with dropout draws its
attention-probability masks (inside the region, over each rank's own heads) from a stream of each
rank's own, and its residual dropout (outside, over replicated values) from the shared one;
activation checkpointing's recompute and a checkpoint's restore replay both."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import DistributedTestFailure, run_distributed

transformers = pytest.importorskip("transformers")

SEQ = 8


def _gpt2(rank):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.5,
                                     resid_pdrop=0.5, embd_pdrop=0.5, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"  # returns the dropped probabilities
    model = transformers.GPT2LMHeadModel(config).train()
    torch.manual_seed(10 + rank)  # each rank its own stream, as many scripts seed: parallelize shares one
    return model


def _ids():
    return torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _forward(model):
    """The first layer's attention probabilities after dropout (this rank's heads) and the logits."""
    out = model(_ids(), output_attentions=True)
    return out.attentions[0] == 0, out.logits.detach()


def _masks(rank, ws, per_rank):
    from parallel_layers.checkpoint import _state
    from parallel_layers.tensor_parallel import parallelize, region_random

    model = _gpt2(rank)
    if not per_rank:  # the single shared stream of before, to show what the region stream changes
        region_random.enter = lambda device: None
    parallelize(model, tp_group=dist.group.WORLD)
    dropped, logits = _forward(model)
    saved = _state.rng_state(rank)  # what a checkpoint saves
    again, _ = _forward(model)
    _forward(model)
    _state.set_rng(saved)  # what a checkpoint load restores
    replayed, _ = _forward(model)
    every = [None] * ws
    dist.all_gather_object(every, (dropped.tolist(), logits.tolist()))  # plain lists: the harness pickles
    return [d for d, _ in every], [lg for _, lg in every], torch.equal(again, replayed), sorted(saved[f"rank{rank}"])


def test_attention_dropout_draws_per_rank_and_the_residual_stream_stays_shared():
    for masks, logits, restored, keys in run_distributed(_masks, 2, args=(True,), timeout_s=240):
        assert torch.tensor(masks[0]).shape == (2, 2, SEQ, SEQ)  # this rank's 2 of the 4 heads
        assert masks[0] != masks[1]  # the ranks' heads are dropped independently
        assert logits[0] == logits[1]  # the residual dropout drew alike: the replicas agree
        assert restored and "tp_region_cpu" in keys  # a checkpoint's RNG state holds the region's too
    # with the shared stream alone, rank 1's heads got exactly rank 0's masks
    for masks, *_ in run_distributed(_masks, 2, args=(False,), timeout_s=240):
        assert masks[0] == masks[1]


def _sequence_parallel_masks(rank, ws, per_rank):
    from parallel_layers.tensor_parallel import parallelize, region_random

    model = _gpt2(rank)
    with torch.no_grad():  # no zero before the residual dropout (a row whose attention was all dropped)
        for block in model.transformer.h:
            block.attn.c_proj.bias.fill_(0.5)
    if not per_rank:  # the shared stream between the regions, as before Note [draws under sequence parallelism]
        region_random.install_sequence_parallel = lambda *args: None
    parallelize(model, tp_group=dist.group.WORLD, sequence_parallel=True)
    dropped = {}
    for name in ("transformer.drop", "transformer.h.0.attn.resid_dropout", "transformer.h.1.mlp.dropout"):
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: dropped.__setitem__(name, (out == 0).tolist()))
    attentions, logits = _forward(model)
    every = [None] * ws
    dist.all_gather_object(every, (dropped, attentions.tolist(), logits.tolist()))
    return every


def test_sequence_parallel_draws_each_ranks_chunk_from_its_own_stream():
    """Note [draws under sequence parallelism]: at tp=2 with the sequence split between the
    regions, the residual dropout over each rank's half of the positions draws masks of its own
    (with the shared stream, rank 1's half got exactly rank 0's masks); attention dropout stays
    per rank, the embedding's dropout (before the split, over the whole sequence) stays shared,
    and the replicated logits agree."""
    every = run_distributed(_sequence_parallel_masks, 2, args=(True,), timeout_s=240)[0]
    (drop0, att0, logits0), (drop1, att1, logits1) = every
    assert torch.tensor(drop0["transformer.h.0.attn.resid_dropout"]).shape == (2, SEQ // 2, 32)  # this rank's chunk
    for name in ("transformer.h.0.attn.resid_dropout", "transformer.h.1.mlp.dropout"):
        assert drop0[name] != drop1[name], name
    assert drop0["transformer.drop"] == drop1["transformer.drop"]
    assert att0 != att1 and logits0 == logits1
    (drop0, att0, logits0), (drop1, att1, logits1) = run_distributed(
        _sequence_parallel_masks, 2, args=(False,), timeout_s=240)[0]
    assert drop0["transformer.h.0.attn.resid_dropout"] == drop1["transformer.h.0.attn.resid_dropout"]


def _replicated_draws_only(rank, ws):
    from parallel_layers.tensor_parallel import parallelize

    torch.manual_seed(0)  # OLMo 2's attention gathers its columns' outputs (q_norm / k_norm over every head)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.5, pad_token_id=0)).train()
    torch.manual_seed(10 + rank)
    parallelize(model, tp_group=dist.group.WORLD, sequence_parallel=True)
    hooked = sorted(n for n, m in model.named_modules() if hasattr(m, "_pl_region_streams"))
    model.gradient_checkpointing_enable()  # transformers' own: nothing of ours to replay here
    model(_ids(), labels=_ids()).loss.backward()
    return hooked


def test_a_layer_that_draws_only_over_replicated_values_is_left_alone():
    """Under sequence parallelism a layer whose only dropout is inside a region that computes
    whole on every rank (OLMo 2's gathered attention) draws from the shared stream: it gets no
    hooks, and transformers' own gradient checkpointing still trains it (review finding)."""
    assert run_distributed(_replicated_draws_only, 2, timeout_s=240) == [[], []]


def _gradients(rank, ws, checkpointing, replay, sp=False):
    from parallel_layers import activation_checkpointing, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(tp=2, device="cpu")
    model = _gpt2(rank)
    if not replay:  # the recompute draws from where the region stream is then
        activation_checkpointing._replaying_region_draws = lambda forward: forward
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), tp_plan="auto",
                      loss_fn=lambda out, labels: causal_lm_loss(out.logits, labels), activation_checkpointing=checkpointing,
                      sequence_parallel=sp)
    grads = {}
    for step in range(2):  # the first step's streams are created in its forward; the second's advanced
        par.optimizer.zero_grad()
        par.forward_backward(_ids(), _ids())
        grads.update({f"{n} {step}": p.grad.tolist() for n, p in model.named_parameters()})
    return grads


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence-parallel"])
def test_a_recompute_replays_the_region_draws(sp):
    """Under sequence parallelism the whole decoder layer's stream is replayed: the residual
    dropout over this rank's chunk too (Note [draws under sequence parallelism])."""
    plain = run_distributed(_gradients, 2, args=(None, True, sp), timeout_s=240)
    for mode in ("full", "selective"):
        recomputed = run_distributed(_gradients, 2, args=(mode, True, sp), timeout_s=240)
        for a, b in zip(plain, recomputed):
            assert all(_close(a[n], b[n]) for n in a), (mode, [n for n in a if not _close(a[n], b[n])][:4])
    # without the replay the recompute is another checkpoint's to the region stream: refused,
    # not trained on other masks
    with pytest.raises(DistributedTestFailure, match="outside parallel_layers' activation checkpointing"):
        run_distributed(_gradients, 2, args=("full", False, sp), timeout_s=240)


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)


def _other_checkpoint(rank, ws):
    from parallel_layers.tensor_parallel import parallelize

    model = _gpt2(rank)
    parallelize(model, tp_group=dist.group.WORLD)
    model.gradient_checkpointing_enable()  # transformers' own: its recompute cannot replay the region stream
    try:
        model(_ids(), labels=_ids()).loss.backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.manual_seed(0)  # a Llama trains without dropout: its regions are left unhooked
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    parallelize(llama, tp_group=dist.group.WORLD)
    hooked = sorted(n for n, m in [*model.named_modules(), *llama.named_modules()] if hasattr(m, "_pl_region_streams"))
    return error, hooked


def test_another_checkpoints_recompute_is_refused_and_regions_without_dropout_are_left_alone():
    for error, hooked in run_distributed(_other_checkpoint, 2, timeout_s=240):
        assert error is not None and "outside parallel_layers' activation checkpointing" in error, error
        assert "activation_checkpointing='full' or 'selective'" in error
        assert hooked == [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn", "mlp")], hooked


def _resumed(rank, ws, directory, layout):
    from parallel_layers import checkpoint, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    model = _gpt2(rank)
    if layout == "pipeline":  # the stage streams (Note [a random stream per pipeline stage])
        par = parallelize(model, init_parallel(pp=2, device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                          pipeline_layers="auto", microbatches=2, loss_fn=causal_lm_loss)
    else:
        par = parallelize(model, init_parallel(tp=2, device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                          tp_plan="auto", loss_fn=lambda out, labels: causal_lm_loss(out.logits, labels),
                          sequence_parallel=layout == "sequence-parallel")

    def step():
        loss = par.forward_backward(_ids(), _ids()).item()
        par.step()
        par.zero_grad()
        return loss

    step()
    path = checkpoint.save(directory, 1, par.module, par.optimizer, prefix=par.prefix)
    after = [step(), step()]
    checkpoint.load(path, par.module, par.optimizer, prefix=par.prefix)  # the model, the optimizer, every stream
    return after, [step(), step()]


@pytest.mark.parametrize("layout", ["tp", "sequence-parallel", "pipeline"])
def test_a_resumed_run_draws_the_region_masks_an_uninterrupted_one_draws(tmp_path, layout):
    """checkpoint.save / load keep the region (and pipeline stage) streams beside the global ones:
    the two steps after a restore repeat the two after the save exactly (with dropout 0.5 in and
    out of the regions)."""
    for after, again in run_distributed(_resumed, 2, args=(str(tmp_path), layout), timeout_s=240):
        assert after == again and after[0] != after[1], (after, again)


def _raised_in_a_region(rank, ws, sp):
    from parallel_layers.tensor_parallel import parallelize

    model = _gpt2(rank)
    parallelize(model, tp_group=dist.group.WORLD, sequence_parallel=sp)
    fail = [True]

    def once(module, args, out):
        if fail.pop() if fail else False:
            raise RuntimeError("out of memory (simulated)")
    handle = model.transformer.h[1].attn.c_attn.register_forward_hook(once)  # inside a region, after its entry
    try:
        model(_ids())
    except RuntimeError:
        pass  # a training loop that skips the batch
    handle.remove()
    logits = model(_ids()).logits.tolist()  # the embedding's dropout first: the shared stream's
    every = [None] * ws
    dist.all_gather_object(every, logits)
    return every[0] == every[1]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence-parallel"])
def test_a_forward_that_raises_inside_a_region_leaves_the_shared_stream_in_place(sp):
    """The region's exit also runs when the forward raises (a caught out-of-memory error):
    else the next forward's replicated dropout drew from each rank's own stream and the TP
    replicas diverged silently (review finding). Under sequence parallelism the decoder layer's
    forward leaves this rank's stream the same way."""
    assert run_distributed(_raised_in_a_region, 2, args=(sp,), timeout_s=240) == [True, True]


def _stage_masks(rank, ws, offset):
    from torch.utils.data import DataLoader

    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline import stage_random
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(pp=2, device="cpu")
    model = _gpt2(rank)
    model.transformer.drop.p = 0.0  # stage 0 draws first for its block, as stage 1 does: the same shapes
    torch.manual_seed(0)  # every rank alike, as scripts that build one model on every rank seed
    if not offset:
        stage_random.seed = lambda *args: None
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), pipeline_layers="auto",
                      split_points=[2], microbatches=2, loss_fn=lambda out, labels: causal_lm_loss(out, labels))
    block = model.transformer.h[rank]  # this stage's block: h.0 on rank 0, h.1 on rank 1
    dropped = []
    block.attn.resid_dropout.register_forward_hook(lambda m, args, out: dropped.append((out == 0).tolist()))
    # the user's draws: the batch (no generator of its own), a DataLoader's shuffle (seeded from
    # the default generator), before and after a step
    ids = torch.randint(0, 64, (2, SEQ))
    par.forward_backward(ids, ids)
    order = [batch.tolist() for batch in DataLoader(list(range(8)), batch_size=4, shuffle=True)]
    every = [None] * ws
    dist.all_gather_object(every, (dropped[0], ids.tolist(), order, torch.rand(2).tolist()))
    return every


def test_pipeline_stages_draw_apart():
    """Note [a random stream per pipeline stage]: seeded alike, stage 1's block drew the very
    residual dropout masks stage 0's block drew; the stages now draw from streams of their own,
    and the user's draws (the batch, a DataLoader's shuffle) stay alike on every pipeline rank,
    as they must: stage 0 reads the inputs, the last stage the targets (review finding: a reseed
    of the default generator made them differ)."""
    (masks0, *user0), (masks1, *user1) = run_distributed(_stage_masks, 2, args=(True,), timeout_s=240)[0]
    assert torch.tensor(masks0).shape == (1, SEQ, 32)  # one microbatch's row
    assert masks0 != masks1
    assert user0 == user1
    (masks0, *user0), (masks1, *user1) = run_distributed(_stage_masks, 2, args=(False,), timeout_s=240)[0]
    assert masks0 == masks1 and user0 == user1
