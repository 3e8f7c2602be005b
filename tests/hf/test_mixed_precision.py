"""parallelize(..., param_dtype=torch.bfloat16): ZeRO's mixed precision over a float32 model, as
FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) gives it (Note [mixed
precision by the parameters] in parallel_layers/parallelize.py), against the same arithmetic done
by hand in one process."""

import copy

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, BATCH, SEQ, VOCAB, LR = 3, 4, 16, 128, 1e-2


def _model(directory, lora: bool):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if lora:
        torch.manual_seed(0)  # the same adapters in every process
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           lora_dropout=0.0, init_lora_weights=False))
    return model


def _trained(model) -> dict:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run(rank, world, directory, stage, lora, fused, microbatches=1, unfreeze_later=False):
    from parallel_layers import checkpoint, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    model = _model(directory, lora)
    if unfreeze_later:  # a layer frozen when ZeRO is built, trained from the first step
        model.model.layers[0].requires_grad_(False)
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                      zero_stage=stage, fused_kernels=fused, param_dtype=torch.bfloat16,
                      microbatches=microbatches, pipeline_layers="auto" if microbatches > 1 else None)
    if unfreeze_later:
        model.model.layers[0].requires_grad_(True)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    losses = _tiny.parallel_losses(par, ctx, _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB))
    return losses, dtypes, checkpoint.save(directory + f"-out{stage}{lora}{fused}", STEPS, par)


def _by_hand(directory, lora, world, microbatches=1):
    """Each replica's rows through a copy of the float32 model whose parameters are bfloat16 (its
    buffers as they are), their gradients - each microbatch's, a 1 / microbatches share of its
    mean - added and averaged in float32 into the float32 model, AdamW there: mixed precision as
    FSDP2 and ZeRO define it."""
    from parallel_layers.pipeline.hf import causal_lm_loss

    master = _model(directory, lora)
    params = [p for p in master.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for ids in _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB):
        for p in params:
            p.grad = torch.zeros_like(p)
        mean = 0.0
        for rows in ids.chunk(world):
            low = copy.deepcopy(master)
            for q in low.parameters():  # the parameters, not the buffers (rotary's inv_freq stays float32)
                q.data = q.data.to(torch.bfloat16)
            for micro in rows.chunk(microbatches):
                loss = causal_lm_loss(low(micro).logits, micro) / microbatches
                loss.backward()
                mean += loss.item() / world
                for p, q in zip(master.parameters(), low.parameters()):
                    if p.requires_grad:
                        p.grad += q.grad.float() / world
                        q.grad = None
        opt.step()
        losses.append(mean)
    return losses, _trained(master)


@pytest.mark.parametrize("stage, lora, microbatches, unfreeze_later", [
    (3, True, 1, False), (1, True, 1, False), (3, False, 1, False), (3, False, 2, False), (1, False, 2, False),
    (3, False, 2, True)])
def test_param_dtype_trains_as_mixed_precision_by_hand(tmp_path, stage, lora, microbatches, unfreeze_later):
    """A float32 Llama (with peft's float32 LoRA adapters on every linear layer, or all of it
    training) at dp2: every parameter computes in bfloat16 - the adapters too, where they ran in
    float32 before - while the masters, the optimizer and the checkpoint stay float32, and every
    step and every trained tensor is the hand-made mixed precision's (float32 rounding); with 2
    microbatches their gradients are added in float32, as FSDP2 adds them (Note [accumulating in
    the reduce dtype] in zero/_param.py; in bfloat16 before: 0.016 off, helper-86) - a layer
    frozen when ZeRO was built and unfrozen before the first step too (it added in bfloat16
    before). The model's own modules (fused_kernels=False): the fused ones round differently in
    bfloat16."""
    _tiny.save_tiny_llama(tmp_path / "src")
    directory = str(tmp_path / "src")
    got = run_distributed(_run, 2, args=(directory, stage, lora, False, microbatches, unfreeze_later), timeout_s=300)
    want_losses, want = _by_hand(directory, lora, 2, microbatches)
    from parallel_layers import checkpoint

    for rank, (_, dtypes, _) in enumerate(got):
        assert dtypes == ["bfloat16"], (rank, dtypes)  # the model as the forward sees it (no pipeline cut: dp only)
    mean = [sum(pair) / 2 for pair in zip(got[0][0], got[1][0])]
    assert mean == pytest.approx(want_losses, abs=1e-6), (mean, want_losses)
    state = {k: v.float() for k, v in checkpoint.export_state_dict(got[0][2]).items()}
    assert sorted(state) == sorted(want)
    worst = max((state[k] - v).abs().max().item() for k, v in want.items())
    assert worst < 1e-5, worst
    start = _trained(_model(directory, lora))
    moved = max((want[k] - start[k]).abs().max().item() for k in want if (lora and "lora_" in k) or not lora)
    assert moved > 1e-3  # it trained: the comparison above sees the updates (100x its tolerance)
    if lora:  # the frozen base as loaded, in float32
        assert all(torch.equal(state[k], start[k]) for k in start if "lora_" not in k)


def test_param_dtype_needs_zero():
    from parallel_layers import parallelize
    from parallel_layers.parallel_dims import ParallelContext

    ctx = object.__new__(ParallelContext)
    with pytest.raises(ValueError, match=r"param_dtype=torch.bfloat16 casts the parameters ZeRO gathers .* needs "
                                         r"zero_stage 1, 2 or 3, got zero_stage=0"):
        parallelize(torch.nn.Linear(2, 2), ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    loss_fn=torch.nn.functional.mse_loss, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"param_dtype must be None .* got torch.int8"):
        parallelize(torch.nn.Linear(2, 2), ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    loss_fn=torch.nn.functional.mse_loss, zero_stage=3, param_dtype=torch.int8)


def _loaded(rank, world, directory, on_meta):
    from parallel_layers import hf, init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(dp=world, device="cpu")
    if on_meta:  # too big for one device: built without storage, the shards filled from the files
        config = transformers.AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = _model(directory, lora=False)
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), loss_fn=causal_lm_loss,
                      zero_stage=3, param_dtype=torch.bfloat16)
    if on_meta:
        hf.load_pretrained(directory, par)
    return _tiny.parallel_losses(par, ctx, _tiny.token_batches(STEPS, BATCH, SEQ, VOCAB))


def test_param_dtype_on_a_model_built_on_the_meta_device():
    """Built on the meta device and loaded from the files by hf.load_pretrained, the bfloat16
    parameters and float32 masters train exactly as the model loaded whole does."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _tiny.save_tiny_llama(tmp)
        whole, meta = (run_distributed(_loaded, 2, args=(tmp, on_meta), timeout_s=300) for on_meta in (False, True))
    assert meta == whole and whole[0] != whole[1], (meta, whole)


def _tied_across_stages(rank, world, directory, stage):
    """One step of 2 microbatches at pp=2: the tied embedding / head's float32 master, against
    the by-hand value, on each copy."""
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    ctx = init_parallel(pp=2, device="cpu")
    model = _model(directory, lora=False)
    tied = model.get_input_embeddings().weight
    assert tied is model.get_output_embeddings().weight
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), loss_fn=causal_lm_loss,
                      zero_stage=stage, fused_kernels=False, param_dtype=torch.bfloat16, pipeline_layers="auto",
                      microbatches=2)
    ids = _tiny.token_batches(1, BATCH, SEQ, VOCAB)[0]
    par.forward_backward(ids, ids)
    par.step()
    sp = next(sp for g in par.module.groups for sp in g.members if sp.full is tied)
    master = sp.shard.detach()[:tied.numel()].view_as(tied)
    master_grad = _tied_by_hand(directory)
    start = _model(directory, lora=False).get_input_embeddings().weight.detach()
    return (master - (start - master_grad)).abs().max().item(), master_grad.abs().max().item()


def _tied_by_hand(directory):
    from parallel_layers.pipeline.hf import causal_lm_loss

    master = _model(directory, lora=False)
    low = copy.deepcopy(master)
    for q in low.parameters():
        q.data = q.data.to(torch.bfloat16)
    # the two stages' copies, apart: each gets its own bfloat16 gradient, added in float32 (one
    # tied tensor would add the embedding's and the head's in bfloat16 first)
    head = low.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    total = torch.zeros_like(master.get_input_embeddings().weight)
    for micro in _tiny.token_batches(1, BATCH, SEQ, VOCAB)[0].chunk(2):
        (causal_lm_loss(low(micro).logits, micro) / 2).backward()
        for copy_ in (low.get_input_embeddings().weight, head.weight):
            total += copy_.grad.float()
            copy_.grad = None
    return total


@pytest.mark.parametrize("stage", [1, 3])
def test_a_weight_tied_across_pipeline_stages_sums_every_microbatch(tmp_path, stage):
    """A tied Llama at pp=2 with 2 microbatches: the copies' gradients are summed over the stages
    with what ZeRO banked of the first microbatch in float32 (Note [accumulating in the reduce
    dtype]); the sum read the last microbatch's .grad alone (helper-87: 40% of the gradient off),
    and the two copies drifted apart."""
    _tiny.save_tiny_llama(tmp_path / "src", tie_word_embeddings=True)
    (off0, grad), (off1, _) = run_distributed(_tied_across_stages, 2, args=(str(tmp_path / "src"), stage),
                                              timeout_s=300)
    assert off0 == off1 and off0 < 1e-6 * max(grad, 1.0) + 1e-6, (off0, off1, grad)

