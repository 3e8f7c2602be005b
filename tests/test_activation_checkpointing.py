"""Activation checkpointing, `parallelize(..., activation_checkpointing="full" | "selective")`:
- it recomputes: the block's forward ops run again in backward ("full": all of them, GEMMs and
  attention included; "selective": the norms, not the GEMMs), fewer bytes are saved for backward,
  and the gradients are those without checkpointing, bit for bit, dropout included;
- the reference GPT and a tiny Hugging Face Llama loaded with from_pretrained train to the
  single-process model's losses, gradient norms and parameters after 3 SGD steps, in both modes,
  at tp2 with sequence parallelism (the GPT's converted by hand, as GPT_TP_PLAN has none; the
  Llama's by its published plan with sequence_parallel=True, in [batch, seq, hidden]), dp2
  ZeRO-3, tp2 x dp2 ZeRO-3 (GPT_TP_PLAN; the Llama's published plan) and pp2 (the Llama cut into
  its own modules by pipeline_layers="auto"); under ZeRO-3 every group is reduced once a step
  and the blocks' parameters are freed after backward, and at dp2 the all-gathers and
  reductions are those of the same training without checkpointing, in the same order (nothing
  gathered for the recompute, no gradient reduced twice);
- the bad calls it refuses, on every rank."""

import copy
import inspect
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from tests._parity import train_one_process, trained_parameters
from tests.dist_harness import run_distributed
from tests.hf._tiny import save_tiny_llama

transformers = pytest.importorskip("transformers")

STEPS = 3
MODES = ("full", "selective")
CFG = dict(vocab=64, seq_len=16, d_model=32, heads=4, layers=2, qkv_bias=False)  # as tests/test_parallelize.py
LR = {"gpt": 0.5, "gpt_sp": 0.5, "llama": 0.1, "llama_sp": 0.1}
# float32: checkpointing changes no arithmetic (the recompute repeats the forward's ops), so
# the layouts differ from one process only in the order of sums, as in tests/test_parallelize.py
# (measured up to 7.5e-7 relative there); 2e-5 still catches a wrong gradient (~1e-2).
RTOL = 2e-5
CLIP = 0.5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(directory)
    return str(directory)


# ---- single process: what is recomputed, what is saved ------------------------------------------
class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _gpt():
    from parallel_layers.models import GPT, Block, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG)), Block


def _step_single(model, mode, block, ids):
    """One forward/backward: the bytes of the distinct storages saved for backward (what an
    outer saved_tensors_hooks sees: SAC's kept tensors included), the ops run in backward, the
    loss and the gradients."""
    from parallel_layers.activation_checkpointing import checkpoint_blocks

    if mode is not None:
        checkpoint_blocks(model, mode, lambda m: isinstance(m, block))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        loss = model.loss(logits, ids[:, 1:]) if hasattr(model, "loss") else \
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    with _CountOps() as ops:
        loss.backward()
    return sum(saved.values()), ops.counts, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpointing_recomputes_and_saves_less(llama_dir):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    aten = torch.ops.aten
    ids = torch.randint(0, 64, (2, CFG["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    for kind in ("gpt", "llama"):
        if kind == "gpt":
            base, block = _gpt()
            norm, gemms = aten.native_layer_norm.default, (aten.mm.default, aten.addmm.default)
        else:
            base, block = transformers.AutoModelForCausalLM.from_pretrained(llama_dir), LlamaDecoderLayer
            norm, gemms = aten.rsqrt.default, (aten.mm.default,)  # RMSNorm: x * rsqrt(mean(x^2) + eps)
        attention = aten._scaled_dot_product_flash_attention_for_cpu.default
        runs = {mode: _step_single(copy.deepcopy(base), mode, block, ids) for mode in (None, *MODES)}
        (saved, ops, loss, grads) = runs[None]
        n_blocks = 2
        assert ops.get(norm, 0) == 0 and ops.get(attention, 0) == 0  # backward alone runs no forward op
        for mode in MODES:
            saved_m, ops_m, loss_m, grads_m = runs[mode]
            assert loss_m == loss and all(torch.equal(grads_m[n], g) for n, g in grads.items()), (kind, mode)
            assert ops_m.get(norm, 0) >= 2 * n_blocks, (kind, mode, ops_m.get(norm))  # the norms: recomputed
            gemm_calls = sum(ops_m.get(op, 0) for op in gemms)
            if mode == "full":  # the GEMMs and the attention too
                assert gemm_calls > sum(ops.get(op, 0) for op in gemms) and ops_m.get(attention, 0) == n_blocks
            else:  # the GEMMs and the attention are kept
                assert gemm_calls == sum(ops.get(op, 0) for op in gemms) and ops_m.get(attention, 0) == 0
        assert runs["full"][0] < runs["selective"][0] < saved, (kind, [runs[m][0] for m in (None, *MODES)])


def test_a_training_forward_runs_without_a_cache_and_the_config_keeps_its_own(llama_dir):
    """Review finding: checkpointing set config.use_cache = False, which hf.save_pretrained then
    wrote into config.json and generation_config.json (the reloaded model generated without a
    cache). A forward with autograd on now runs without a cache, per call; the config is untouched."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from parallel_layers.activation_checkpointing import checkpoint_blocks

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert model.config.use_cache
    checkpoint_blocks(model, "full", lambda m: isinstance(m, LlamaDecoderLayer))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    assert model.config.use_cache
    for mode in ("train", "eval"):  # from_pretrained gives an eval-mode model, which people also train
        out = getattr(model, mode)()(ids, use_cache=True)
        assert out.past_key_values is None, mode  # the recompute would fill a cache a second time
        out.logits.sum().backward()
    with torch.no_grad():
        assert model.eval()(ids).past_key_values is not None  # generation keeps its cache
    # use_cache given by position (review finding: "got multiple values for argument 'use_cache'")
    position = list(inspect.signature(model.forward).parameters).index("use_cache")
    assert model.train()(ids, *[None] * (position - 1), True).past_key_values is None

    class Wrapper(torch.nn.Module):  # a user's model around the transformers one, its config exposed
        def __init__(self, lm):
            super().__init__()
            self.lm, self.config = lm, lm.config

        def forward(self, ids):  # no use_cache argument: the pre-hook must not give one (review finding)
            return self.lm(input_ids=ids).logits

    wrapper = Wrapper(transformers.AutoModelForCausalLM.from_pretrained(llama_dir))
    checkpoint_blocks(wrapper, "full", lambda m: isinstance(m, LlamaDecoderLayer))
    caches = []
    wrapper.lm.register_forward_hook(lambda m, args, out: caches.append(out.past_key_values))
    wrapper(ids).sum().backward()
    assert caches == [None]  # the transformers model inside runs without one

def test_selective_recomputes_the_attention_core_of_the_math_path(llama_dir):
    # Eager attention (matmul, softmax, matmul): its O(seq^2) scores are recomputed, as in
    # Megatron's selective recompute; the linear layers' GEMMs (mm) are kept.
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    aten = torch.ops.aten
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
    ids = torch.randint(0, 128, (2, CFG["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    runs = {mode: _step_single(copy.deepcopy(base), mode, LlamaDecoderLayer, ids) for mode in (None, "selective")}
    (saved, ops, loss, grads), (saved_s, ops_s, loss_s, grads_s) = runs[None], runs["selective"]
    assert loss_s == loss and all(torch.equal(grads_s[n], g) for n, g in grads.items())
    n_blocks = 2
    assert ops_s.get(aten._softmax.default, 0) == n_blocks and ops.get(aten._softmax.default, 0) == 0
    assert ops_s.get(aten.bmm.default, 0) == ops.get(aten.bmm.default, 0) + 2 * n_blocks  # QK^T and AV again
    assert ops_s.get(aten.mm.default, 0) == ops.get(aten.mm.default, 0)  # no linear layer again
    assert saved_s < saved


class _DropoutBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(d, 4 * d), nn.Dropout(0.5), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.drop(F.gelu(self.up(x))))


def test_dropout_draws_the_same_mask_in_the_recompute():
    from parallel_layers.activation_checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    base = nn.Sequential(*[_DropoutBlock(16) for _ in range(2)])
    x = torch.randn(4, 16)
    grads = {}
    for mode in (None, *MODES):
        model = copy.deepcopy(base)
        if mode is not None:
            checkpoint_blocks(model, mode, lambda m: isinstance(m, _DropoutBlock))
        torch.manual_seed(1)
        model(x).square().sum().backward()
        grads[mode] = [p.grad for p in model.parameters()]
        grads[mode].append(torch.rand(1))  # the RNG stream after the step: the recompute does not advance it
    for mode in MODES:
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads[None])), mode


@torch.library.custom_op("pl_test::dropped_attention", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropped_attention(q: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """What a GPU's fused attention kernel (flash, memory-efficient) is to the recompute: one op
    that draws its dropout mask from the default generator itself."""
    w = torch.softmax(q @ q.transpose(-1, -2), -1)
    return (w * (torch.rand_like(w) >= dropout_p) / (1 - dropout_p) if dropout_p > 0 else w) @ q


@_dropped_attention.register_fake
def _(q, dropout_p):
    return torch.empty_like(q)


_dropped_attention.register_autograd(
    lambda ctx, grad: (torch.ops.aten.mul(grad, ctx.scale), None),  # the gradient's exact form does not matter
    setup_context=lambda ctx, inputs, output: setattr(ctx, "scale", 1.0))


class _FusedAttentionBlock(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.up, self.p, self.drop = nn.Linear(d, d), p, nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(_dropped_attention(self.up(x), self.p))  # then dropout on the residual stream


@pytest.mark.parametrize("p", [0.5, 0.0])
def test_selective_recomputes_a_kept_op_that_draws(monkeypatch, p):
    """Note [kept ops that draw]: kept, a fused attention with dropout was skipped by the
    recompute, which then drew the residual dropout's mask from an earlier point of the stream:
    wrong gradients. With dropout it is recomputed; without, kept."""
    from parallel_layers import activation_checkpointing

    monkeypatch.setattr(activation_checkpointing, "_gemms",  # as the GPU kernels are kept
                        lambda: activation_checkpointing._GEMMS | {torch.ops.pl_test.dropped_attention.default})
    kept = []
    policy = activation_checkpointing._SelectivePolicy.__call__
    monkeypatch.setattr(activation_checkpointing._SelectivePolicy, "__call__", lambda self, ctx, func, *a, **k: (
        kept.append(func) if (r := policy(self, ctx, func, *a, **k)) == CheckpointPolicy.MUST_SAVE else None) or r)
    torch.manual_seed(0)
    base = nn.Sequential(*[_FusedAttentionBlock(8, p) for _ in range(2)])
    x = torch.randn(4, 8)
    grads = {}
    for mode in (None, "selective"):
        model = copy.deepcopy(base)
        if mode is not None:
            activation_checkpointing.checkpoint_blocks(model, mode, lambda m: isinstance(m, _FusedAttentionBlock))
        torch.manual_seed(1)
        model(x).square().sum().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["selective"], grads[None]))
    assert (torch.ops.pl_test.dropped_attention.default in kept) == (p == 0.0)


class _SdpaBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.qkv, self.heads, self.drop = nn.Linear(d, 3 * d), heads, nn.Dropout(0.5)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
        return x + self.drop(a.transpose(1, 2).reshape(b, s, d))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selective_with_fused_attention_dropout_on_cuda(dtype):
    """Note [kept ops that draw] on the kernels themselves: flash (bfloat16) or memory-efficient
    (float32) attention with dropout, then dropout on the residual stream."""
    from parallel_layers.activation_checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    base = nn.Sequential(*[_SdpaBlock(64, 4) for _ in range(2)]).cuda().to(dtype)
    x = torch.randn(2, 128, 64, device="cuda", dtype=dtype)
    grads = {}
    for mode in (None, "selective"):
        model = copy.deepcopy(base)
        if mode is not None:
            checkpoint_blocks(model, mode, lambda m: isinstance(m, _SdpaBlock))
        torch.manual_seed(1)
        model(x).float().square().sum().backward()
        grads[mode] = [p.grad.float() for p in model.parameters()]
    # the flash backward may add in another order; another mask would be off by O(1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(grads["selective"], grads[None]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


class _RowLike(nn.Module):
    """What the row-parallel layer does: a GEMM, then writes into its output in place (there an
    all-reduce and the bias), then elementwise ops that the recompute must see after both."""

    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(d, d) / d ** 0.5), nn.Parameter(torch.randn(d))

    def forward(self, x):
        y = x @ self.w
        y.add_(self.b)
        y.mul_(2.0)
        return torch.tanh(y) * x


def test_selective_keeps_in_place_writes_into_a_kept_gemm_output():
    # A recompute that repeated the add_ and mul_ on the kept GEMM output would double-apply
    # them (Note [selective writes]); the gradients say whether it did.
    from parallel_layers.activation_checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    base = nn.Sequential(_RowLike(8), _RowLike(8))
    x = torch.randn(4, 8)
    grads = []
    for mode in (None, "selective"):
        model = copy.deepcopy(base)
        if mode is not None:
            checkpoint_blocks(model, mode, lambda m: isinstance(m, _RowLike))
        model(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _WritesAfterARead(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x @ self.w  # kept
        z = y.sigmoid()  # recomputed, reading y
        y.add_(1)  # ... which the recompute would see written
        return (y * z).sum()


def test_selective_refuses_what_it_cannot_recompute_and_bad_arguments():
    from parallel_layers.activation_checkpointing import checkpoint_blocks

    model = nn.Sequential(_WritesAfterARead())
    checkpoint_blocks(model, "selective", lambda m: isinstance(m, _WritesAfterARead))
    with pytest.raises(RuntimeError, match=r"activation_checkpointing='selective': aten.add_.Tensor writes in place "
                                           r"into the output of a kept GEMM that aten.sigmoid.default read before"):
        model(torch.randn(3, 4))
    model, _ = _gpt()
    with pytest.raises(ValueError, match=r"wrap= selects 'layers.1.ln1' inside the block 'layers.1'; checkpointed "
                                         r"blocks must not nest"):
        checkpoint_blocks(model, "full", lambda m: type(m).__name__ in ("Block", "LayerNorm"))
    with pytest.raises(ValueError, match="activation_checkpointing='full': wrap= selects no module of GPT"):
        checkpoint_blocks(model, "full", lambda m: False)
    checkpoint_blocks(model, "full", lambda m: type(m).__name__ == "Block")
    ids = torch.randint(0, 64, (2, 8))
    for copied in (copy.deepcopy(model), _pickled(model)):  # a copy runs its own forward, under checkpoint
        twin = copied.layers[1]
        assert twin.forward.args == (twin,) and twin._pl_forward.__self__ is twin
        torch.testing.assert_close(copied(ids), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"activation checkpointing is already applied to 'layers.1' \('full'\)"):
        checkpoint_blocks(model, "selective", lambda m: type(m).__name__ == "Block")


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ---- distributed parity -------------------------------------------------------------------------
def _sequence_parallel_forward(self, x):  # Block.forward, with the sequence length of the gathered qkv
    qkv = self.qkv(self.ln1(x))
    s, b, _ = qkv.shape
    q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in qkv.chunk(3, -1))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
    x = x + self.proj(attn)
    return x + self.down(self.act(self.up(self.ln2(x))))


def _sequence_parallel(model, group):
    """The GPT with Megatron's sequence parallelism, by hand (GPT_TP_PLAN has none): each block's
    layers are SP layers, activations between blocks are split on the sequence."""
    from parallel_layers.models import Block
    from parallel_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, reduce_grad_over_tp
    from parallel_layers.tensor_parallel.comm import gather_from_sp, scatter_to_sp

    class SequenceParallelBlock(Block):
        forward = _sequence_parallel_forward

    for b in (m for m in model.modules() if isinstance(m, Block)):
        b.__class__ = SequenceParallelBlock  # still a Block: wrap= selects it
        d = b.ln1.normalized_shape[0]
        b.qkv = ColumnParallelLinear.from_linear(b.qkv, fused_sizes=(d, d, d), sequence_parallel=True, tp_group=group)
        b.proj = RowParallelLinear.from_linear(b.proj, sequence_parallel=True, tp_group=group)
        b.up = ColumnParallelLinear.from_linear(b.up, activation="gelu_tanh", sequence_parallel=True, tp_group=group)
        b.act = nn.Identity()  # applied by up's fused kernel
        b.down = RowParallelLinear.from_linear(b.down, sequence_parallel=True, tp_group=group)
        for p in (*b.ln1.parameters(), *b.ln2.parameters()):  # each rank sees its sequence chunk only
            reduce_grad_over_tp(p, group)
    model.layers[0].register_forward_hook(lambda m, args, out: scatter_to_sp(out, group))
    # the head computes the whole loss on every rank: its input's gradient is complete (no sum)
    model.layers[-1].register_forward_pre_hook(
        lambda m, args: (gather_from_sp(args[0], group, replicated_consumer=True),))


def _llama_loss(out, targets):  # the model's ModelOutput, or the last pipeline stage's logits
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(kind, directory):
    """(model, tp plan, block type, loss_fn): the single-device model, built alike on every rank."""
    if kind in ("llama", "llama_sp"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return transformers.AutoModelForCausalLM.from_pretrained(directory), "auto", LlamaDecoderLayer, _llama_loss
    from parallel_layers.models import GPT_TP_PLAN

    model, block = _gpt()
    return model, (None if kind == "gpt_sp" else GPT_TP_PLAN), block, model.loss


def _data(kind, batch):
    vocab = 128 if kind.startswith("llama") else CFG["vocab"]
    ids = torch.randint(0, vocab, (STEPS, batch, CFG["seq_len"] + 1), generator=torch.Generator().manual_seed(3))
    return ids[..., :-1], ids[..., 1:]


def _single_process(kind, directory, batch):
    model, _, _, loss_fn = _build(kind, directory)
    model.train()
    ids, targets = _data(kind, batch)
    return train_one_process(model, loss_fn, torch.optim.SGD(model.parameters(), lr=LR[kind]), ids,
                             targets, CLIP)


class _ZeROCalls:
    """The ZeRO groups' all-gathers (launched) and gradient reductions, in order."""

    def __init__(self):
        from parallel_layers.zero._group import ParamGroup

        self.calls = []
        start, reduce = ParamGroup.start_unshard, ParamGroup.reduce_grads
        calls = self.calls

        def start_unshard(group):
            if not group.is_unsharded and group._inflight is None:
                calls.append(("all_gather", group.name))
            return start(group)

        def reduce_grads(group, *args, **kwargs):
            calls.append(("reduce", group.name))
            return reduce(group, *args, **kwargs)

        ParamGroup.start_unshard, ParamGroup.reduce_grads = start_unshard, reduce_grads


def _train(kind, ctx, directory, mode, zero_stage, microbatches, calls):
    from parallel_layers import parallelize

    model, plan, block, loss_fn = _build(kind, directory)
    if kind == "gpt_sp":
        _sequence_parallel(model, ctx.tp_group)
    model.train()
    hf = kind.startswith("llama")  # pipelined as its own modules (pipeline/hf.py)
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR[kind]), loss_fn=loss_fn,
                      tp_plan=plan, sequence_parallel=kind == "llama_sp", activation_checkpointing=mode,
                      # the Llama's blocks by default: its _no_split_modules, the decoder layers
                      zero_stage=zero_stage, wrap=None if hf else lambda m: isinstance(m, block),
                      pipeline_layers=("auto" if ctx.dims.pp > 1 else None) if hf else "layers",
                      microbatches=microbatches)
    blocks = [m for m in model.modules() if isinstance(m, block)]
    assert all(getattr(m, "_pl_activation_checkpointing", None) == mode for m in blocks)
    dp = ctx.dims.dp
    per_replica = 2 * (microbatches or 1)
    ids, targets = _data(kind, per_replica * dp)
    rows = slice(ctx.coordinate("dp") * per_replica, (ctx.coordinate("dp") + 1) * per_replica)
    losses, norms, freed = [], [], True
    del calls[:]
    for step in range(STEPS):
        loss = par.forward_backward(ids[step][rows], targets[step][rows]).clone()
        if zero_stage == 3:  # the blocks' full parameters are freed after their backward (recompute included)
            freed &= all(p.untyped_storage().size() == 0 for m in blocks for p in m.parameters())
        norms.append(par.clip_grad_norm_(CLIP).item())
        par.step()
        par.zero_grad()
        dist.all_reduce(loss, group=ctx.dp_group)
        losses.append(loss.item() / dp)
    params = trained_parameters(model, par, ctx)
    return losses, norms, params, list(calls), freed


def _layout_runs(tp, dp, pp, zero_stage):
    """The (kind, mode) trainings of a layout: kept few, as each costs ~40 collectives a step.
    tp2 runs sequence parallelism (the GPT's by hand, the Llama's by the published plan); the
    plain TP plans at tp2 run in tp2 x dp2; the training without checkpointing (None), whose
    ZeRO-3 collectives the others must repeat, at dp2."""
    if (tp, dp, pp) == (2, 1, 1):
        kinds = ["gpt_sp", "llama_sp"]
    else:
        kinds = ["gpt", "llama"]
    modes = (None, *MODES) if zero_stage == 3 and tp == 1 else MODES
    return [(kind, mode) for kind in kinds for mode in modes]


def _parity(rank, world, tp, dp, pp, zero_stage, microbatches, directory, references):
    from parallel_layers import init_parallel, parallelize

    ctx = init_parallel(tp=tp, dp=dp, pp=pp, device="cpu")
    calls = _ZeROCalls().calls
    report = {}
    for kind, mode in _layout_runs(tp, dp, pp, zero_stage):
        ref_losses, ref_norms, ref_params = references[kind]
        losses, norms, params, zero_calls, freed = _train(kind, ctx, directory, mode, zero_stage, microbatches, calls)
        loss_diff = max(abs(a - b) / b for a, b in zip(losses + norms, ref_losses + ref_norms))
        param_diff = max(((params[n] - ref_params[n]).abs().max() / ref_params[n].abs().max()).item() for n in params)
        report[(kind, mode)] = dict(loss_diff=loss_diff, param_diff=param_diff, n_params=len(params),
                                    zero_calls=zero_calls, freed=freed)
    # Refused on every rank, before any collective: a bad mode, a mode without blocks.
    messages = []
    model = _gpt()[0]
    for mode, wrap in (("fast", None), (True, None), ("full", None)):
        try:
            parallelize(model, ctx, optimizer=torch.optim.SGD, loss_fn=model.loss, activation_checkpointing=mode,
                        wrap=wrap, pipeline_layers="layers")
        except ValueError as e:
            messages.append(str(e))
    return report, messages


_REFERENCES = {}


def _reference(kind, directory, batch):
    """The single-process training, computed once here rather than on every rank."""
    key = (kind.removesuffix("_sp"), batch)  # a sequence-parallel model's reference is the plain model's
    if key not in _REFERENCES:
        _REFERENCES[key] = _single_process(key[0], directory, batch)
    return _REFERENCES[key]


@pytest.mark.parametrize("tp,dp,pp,zero_stage", [
    (2, 1, 1, 0),  # tensor parallel with sequence parallelism, the GPT and the Llama
    (1, 2, 1, 3),  # ZeRO-3 over dp=2
    (2, 2, 1, 3),  # tp2 x dp2, ZeRO-3: GPT_TP_PLAN, the Llama's published plan
    (1, 1, 2, 0),  # pp=2, 1f1b over 2 microbatches (the Llama cut by pipeline_layers="auto")
])
def test_checkpointed_layouts_match_one_process(tp, dp, pp, zero_stage, llama_dir):
    microbatches = 2 if pp > 1 else None
    runs = _layout_runs(tp, dp, pp, zero_stage)
    references = {kind: _reference(kind, llama_dir, 2 * (microbatches or 1) * dp) for kind, _ in runs}
    results = run_distributed(_parity, tp * dp * pp, args=(tp, dp, pp, zero_stage, microbatches, llama_dir,
                                                            references), timeout_s=240)
    for rank, (report, messages) in enumerate(results):
        assert list(report) == runs
        for (kind, mode), r in report.items():
            assert r["loss_diff"] < RTOL and r["param_diff"] < RTOL and r["n_params"] > 0, (rank, kind, mode, r)
            if zero_stage == 3:
                assert r["freed"], (rank, kind, mode)
                reductions = [name for op, name in r["zero_calls"] if op == "reduce"]
                assert len(reductions) == STEPS * len(set(reductions)) > 0, (rank, kind, reductions)
            if (kind, None) in report:
                # the same all-gathers and reductions, in the same order, as without checkpointing
                assert r["zero_calls"] == report[(kind, None)]["zero_calls"], (rank, kind, mode)
        assert messages == [
            "activation_checkpointing must be one of None, 'full', 'selective' (per block: 'full' recomputes the "
            "whole block in backward, 'selective' keeps its GEMM outputs and recomputes the rest), got 'fast'",
            "activation_checkpointing must be one of None, 'full', 'selective' (per block: 'full' recomputes the "
            "whole block in backward, 'selective' keeps its GEMM outputs and recomputes the rest), got True",
            "activation_checkpointing='full' checkpoints the blocks that wrap= selects (the modules ZeRO groups its "
            "parameters by; a Hugging Face model's default: the classes in its _no_split_modules); pass wrap=, e.g. "
            "wrap=lambda m: isinstance(m, Block)"], messages
