"""parallel_layers.fused: a Hugging Face decoder's SwiGLU MLPs swapped for SwiGLUMLP (one GEMM on
the packed [gate; up] weight, activation fused) - or, where gate and up are one packed layer
already (Phi-3, GLM-4), PackedSwiGLUMLP - its RMSNorms for FusedRMSNorm, over the
same parameters, and its layers' residual add fused into the post-attention norm, against the
plain transformers model from the same directory. Tensor-parallel, sequence-parallel, ZeRO and
pipelined runs of the fused model are the parity tests of those features (parallelize fuses by
default: tests/tensor_parallel/test_parallelize.py, test_sequence_parallel_hf.py,
tests/hf/test_pretrained.py, ...)."""

import copy
import functools
import hashlib
import inspect
import io
import tokenize
import unittest.mock
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_layers import fused, meta
from parallel_layers.ops import FusedRMSNorm
from parallel_layers.tensor_parallel import parallelize as tp_parallelize
from parallel_layers.tensor_parallel import published_plan
from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, PackedSwiGLUMLP, RowParallelLinear, SwiGLUMLP
from parallel_layers.tensor_parallel.plan import Column, Row
from tests.hf._tiny import (save_tiny_gpt2, save_tiny_llama, save_tiny_mistral, save_tiny_phi3, save_tiny_qwen2,
                            train_losses)
from tests.ops.numerics import devices

transformers = pytest.importorskip("transformers")

SAVE = {"llama": save_tiny_llama, "qwen2": save_tiny_qwen2, "mistral": save_tiny_mistral}


def _packed(mlp: SwiGLUMLP) -> bool:
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    return (gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
            and up.storage_offset() == gate.storage_offset() + gate.numel())


def _train(model, steps=3):
    return train_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps, vocab=128)


@pytest.mark.parametrize("family", sorted(SAVE))
def test_fused_model_trains_as_the_plain_one(tmp_path, family):
    SAVE[family](tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    norms = {n: m.weight for n, m in model.named_modules() if n.endswith("norm")}
    names = fused.fuse(model)
    mlps = [f"model.layers.{i}.mlp" for i in range(2)]
    layers = [f"model.layers.{i}" for i in range(2)]  # the residual add fused (an instance forward)
    assert sorted(names) == sorted(mlps + list(norms) + layers) and len(norms) == 5  # 2 per layer, the final one
    assert all("forward" in vars(model.get_submodule(n)) for n in layers)
    assert all(isinstance(model.get_submodule(n), SwiGLUMLP) and _packed(model.get_submodule(n)) for n in mlps)
    for name, weight in norms.items():  # the same Parameter object: optimizer, hooks, names unchanged
        assert isinstance(model.get_submodule(name), FusedRMSNorm) and model.get_submodule(name).weight is weight
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with _OpCounter() as ops:
        logits = model(ids).logits
    assert ops.count("rms_norm_add") == 2 and ops.count("rms_norm") == 3  # one add per layer; input + final
    torch.testing.assert_close(logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
    # one packed GEMM vs two, the norm's sum of squares in float64 vs a float32 cascade: ~1e-7
    # relative in the gradients; AdamW divides by sqrt(v), so where a gradient is near zero a
    # weight moves by up to lr * (its relative change): the 1e-4 bound
    assert _train(model) == pytest.approx(_train(plain), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
    assert all(_packed(model.get_submodule(n)) for n in mlps)  # the optimizer updated the views in place


class _OpCounter(TorchDispatchMode):
    """Which parallel_layers ops a forward runs (below autograd: the ops themselves)."""

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "parallel_layers":
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))

    def count(self, name):
        return self.ops.count(name)


@pytest.mark.parametrize("device", devices())
def test_fused_residual_add(tmp_path, device):
    """The fused layer's forward against the model's own, in each dtype and under autocast (where
    the attention output is bfloat16 and the stream float32: the model's three statements run)."""
    save_tiny_llama(tmp_path)

    def load(dtype=torch.float32, layers_forward=False):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(device)
        fused.fuse(model)
        if layers_forward:  # the same fused modules under the layers' own forward
            for layer in model.model.layers:
                del layer.forward
        return model

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(device)
        model, unfused = load(dtype), load(dtype, layers_forward=True)
        # the same bits forward (the sum rounded once to the dtype, then the same norm); in
        # backward the fused op adds the stream's gradient to the norm's input gradient before
        # rounding, autograd after (two roundings): within a few units of the dtype's precision
        # of each gradient's scale
        with _OpCounter() as ops:
            out = model(ids).logits
        assert ops.count("rms_norm_add") == 2
        ref = unfused(ids).logits
        assert torch.equal(out, ref)
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), unfused.parameters()):
            scale = q.grad.abs().max().item()
            assert (p.grad - q.grad).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale, n
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, **tol)
    model, unfused = load(), load(layers_forward=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        with _OpCounter() as ops:
            out = model(ids).logits
        assert ops.count("rms_norm_add") == 0
        assert torch.equal(out, unfused(ids).logits)


def test_only_llamas_decoder_forward_gets_the_fused_residual_add(tmp_path):
    """Only the layers whose forward is token for token Llama's are changed (read through
    transformers' checkpointing wrapper only); fusing twice changes nothing; a deep copy and a
    pickled model run their own modules."""
    from transformers.models import llama, mistral, qwen2, qwen3

    families = [llama.modeling_llama.LlamaDecoderLayer, mistral.modeling_mistral.MistralDecoderLayer,
                qwen2.modeling_qwen2.Qwen2DecoderLayer, qwen3.modeling_qwen3.Qwen3DecoderLayer]
    for cls in families:  # the digest is that of the installed transformers' forward of each family
        tokens = fused._forward_tokens(cls)
        assert hashlib.sha256(tokens.encode()).hexdigest() == fused._LLAMA_DECODER_FORWARD, cls.__name__
    save_tiny_llama(tmp_path)

    class Layer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):  # another computation: not changed
            return super().forward(hidden_states * 2, *args, **kwargs)

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model.model.layers[0] = Layer(config, 0)
    names = fused.fuse(model)
    assert "model.layers.1" in names and "model.layers.0" not in names and "forward" not in vars(model.model.layers[0])
    assert fused.fuse(model) == []  # twice: nothing left to change

    # a later transformers whose decoder forward differs: the layers run their own, and fuse says so
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"fuse: 2 LlamaDecoderLayer of transformers \S+ keep their own forward"):
        with unittest.mock.patch.object(fused, "_LLAMA_DECODER_FORWARD", "0" * 64):
            names = fused.fuse(model)
    assert not any(n.startswith("model.layers.") and n.count(".") == 2 for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every known module fused: no warning
        assert "model.layers.0" in fused.fuse(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    llama_layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer

    class Wrapped(llama_layer):  # Llama's own forward under a decorator: its source reads as Llama's
        forward = _doubled_input(inspect.unwrap(llama_layer.forward))

    model.model.layers[0] = Wrapped(config, 0)
    assert fused._forward_tokens(llama_layer) == " ".join(
        t.string for t in tokenize.generate_tokens(io.StringIO(inspect.getsource(Wrapped.forward)).readline)
        if t.type not in fused._LAYOUT_TOKENS)
    assert "model.layers.0" not in fused.fuse(model) and "forward" not in vars(model.model.layers[0])

    ids = torch.randint(0, 128, (1, 8))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    fused.fuse(model)
    for copied in (copy.deepcopy(model), _pickled(model)):  # each copy's layers run their own modules
        layer = copied.model.layers[1]
        assert layer.forward.args == (layer,) and torch.equal(copied(ids).logits, model(ids).logits)


def _doubled_input(forward):
    @functools.wraps(forward)
    def wrapper(self, hidden_states, *args, **kwargs):
        return forward(self, hidden_states * 2, *args, **kwargs)
    return wrapper


def test_fused_layers_keep_transformers_gradient_checkpointing(tmp_path):
    """model.gradient_checkpointing_enable() wraps the decoder layer class's forward; a fused layer
    training with it enabled runs that wrapper (unfused, checkpointed), not around it."""
    save_tiny_llama(tmp_path)
    models = {}
    for name in ("fused", "class_forward", "fused_no_checkpointing"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        if name != "fused_no_checkpointing":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert "model.layers.0" in fused.fuse(model)
        if name == "class_forward":  # the fused modules under the class's (checkpointing) forward
            for layer in model.model.layers:
                del layer.forward
        models[name] = model
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    saved, grads = {}, {}
    for name, model in models.items():
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        saved[name] = sum(count)
        grads[name] = [p.grad for p in model.parameters()]
    # checkpointed: the layers keep their inputs only
    assert saved["fused"] == saved["class_forward"] < saved["fused_no_checkpointing"] / 2, saved
    for g, h in zip(grads["fused"], grads["fused_no_checkpointing"]):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)
    models["fused"].eval()  # not training: the fused forward
    with _OpCounter() as ops:
        models["fused"](ids)
    assert ops.count("rms_norm_add") == 2


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_packing_survives_a_move_and_a_meta_build(tmp_path):
    save_tiny_llama(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    fused.fuse(model)
    mlp = model.model.layers[0].mlp
    gate = mlp.gate_proj.weight
    model.double()  # every parameter gets storage of its own
    assert mlp.gate_proj.weight is gate and not _packed(mlp)
    ids = torch.randint(0, 128, (1, 8))
    before = model(ids).logits  # unpacked: correct, through a copy of the two weights
    fused.pack(model)
    assert _packed(mlp) and mlp.gate_proj.weight is gate
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(config)
    fused.fuse(on_meta)
    with pytest.warns(RuntimeWarning, match=r"rotary_emb\.inv_freq"):  # zeros: hf.materialize computes them
        meta.materialize(on_meta, "cpu")
    assert all(_packed(layer.mlp) for layer in on_meta.model.layers)


class _ScaledMLP(nn.Module):
    """A SwiGLU-shaped MLP whose forward computes something else: must not be fused."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


def test_only_what_computes_a_swiglu_is_fused(tmp_path):
    save_tiny_gpt2(tmp_path)
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a family fuse() knows: nothing to say
        assert fused.fuse(gpt2) == []
        assert fused.fuse(nn.Sequential(_ScaledMLP())) == []
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, vocab_size=128, hidden_act="gelu")
    with pytest.warns(UserWarning, match=r"fuse: 1 LlamaMLP of transformers \S+ keep their own forward, unfused"):
        names = fused.fuse(transformers.LlamaForCausalLM(config))
    assert not any(n.endswith("mlp") for n in names)  # not a SiLU gate
    config.hidden_act = "silu"
    assert tp_parallelize(transformers.LlamaForCausalLM(config), fused_kernels=False).model.layers[0].mlp.__class__ \
        is transformers.models.llama.modeling_llama.LlamaMLP
    assert isinstance(tp_parallelize(transformers.LlamaForCausalLM(config)).model.layers[0].mlp, SwiGLUMLP)


def test_an_mlp_that_does_more_than_the_swiglu_is_left_alone():
    # Seed-OSS's MLP is Llama's plus a dropout on its output (residual_dropout): the swap matched
    # the expression inside its forward and trained without that dropout (review finding)
    config = transformers.SeedOssConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        residual_dropout=0.5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    mlp = model.model.layers[0].mlp
    names = fused.fuse(model)
    assert "model.layers.0.mlp" not in names and model.model.layers[0].mlp is mlp
    mlp.train()
    zeros = (mlp(torch.randn(4, 8, 32)) == 0).float().mean().item()
    assert 0.3 < zeros < 0.7  # its dropout of 0.5 still runs


def test_hooks_on_a_fused_mlps_projections_run(tmp_path):
    # the fused MLP reads gate_proj's and up_proj's weights: their hooks never fired, silently
    # (review finding); with hooks it calls them as modules (Note [hooks on fused parts])
    save_tiny_llama(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    calls = {"gate": 0, "up": 0, "norm": []}
    model.model.layers[0].mlp.gate_proj.register_forward_hook(  # before the swap
        lambda m, args, out: calls.update(gate=calls["gate"] + 1))
    fused.fuse(model)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP)
    mlp.up_proj.register_forward_hook(lambda m, args, out: calls.update(up=calls["up"] + 1))  # after it
    model.model.layers[1].post_attention_layernorm.register_forward_hook(
        lambda m, args, out: calls["norm"].append(type(out).__name__))
    ids = torch.randint(0, 128, (2, 8))
    logits = model(ids).logits
    torch.testing.assert_close(logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert calls == {"gate": 1, "up": 1, "norm": ["Tensor"]}  # the norm's hook sees its one output, not a pair
    logits.sum().backward()  # backward through the modules
    plain(ids).logits.sum().backward()
    torch.testing.assert_close(mlp.gate_proj.weight.grad, plain.model.layers[0].mlp.gate_proj.weight.grad,
                               rtol=1e-5, atol=1e-6)


def test_torchs_global_module_hooks_leave_the_fusion_on(tmp_path):
    # FlopCounterMode (and CommDebugMode) register global module hooks: counted as hooks, they
    # left a model parallelized under one unfused for good, with warnings that blamed its modules
    from torch.utils.flop_counter import FlopCounterMode

    save_tiny_llama(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FlopCounterMode(display=False):
            names = fused.fuse(model)
    assert isinstance(model.model.layers[0].mlp, SwiGLUMLP) and len(names) == 9  # 2 MLPs, 5 norms, 2 layers


def test_a_module_with_hooks_of_its_own_is_not_swapped(tmp_path):
    save_tiny_llama(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    mlp, norm = model.model.layers[0].mlp, model.model.layers[0].post_attention_layernorm
    mlp.register_forward_pre_hook(lambda m, args: None)  # the swap would drop them
    norm.register_forward_hook(lambda m, args, out: None)
    with pytest.warns(UserWarning, match=r"fuse: 2 module\(s\) that it would swap have hooks, which the fused "
                                         r"module would not carry.*'model.layers.0.mlp'"):
        names = fused.fuse(model)
    assert model.model.layers[0].mlp is mlp and model.model.layers[0].post_attention_layernorm is norm
    assert "model.layers.0" not in names and "model.layers.1.mlp" in names  # layer 0 keeps its own add


def test_swiglu_mlp_refuses_unmatched_projections():
    with pytest.raises(TypeError, match="gate_proj and up_proj must both be ColumnParallelLinear or both nn.Linear, "
                                        "got Linear and ColumnParallelLinear"):
        SwiGLUMLP(nn.Linear(8, 16), ColumnParallelLinear(8, 16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"must match: weights \(16, 8\) and \(12, 8\)"):
        SwiGLUMLP(nn.Linear(8, 16), nn.Linear(8, 12), nn.Linear(16, 8))
    with pytest.raises(TypeError, match="fused_kernels must be True or False, got 'yes'"):
        tp_parallelize(nn.Linear(2, 2), {}, fused_kernels="yes")


def _save_tiny_glm4(directory):
    config = transformers.Glm4Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, vocab_size=128, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Glm4ForCausalLM(config).save_pretrained(directory)


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_packed_gate_up_mlps_fuse_and_train_as_the_plain_one(tmp_path, family):
    (save_tiny_phi3 if family == "phi3" else _save_tiny_glm4)(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = [layer.mlp.gate_up_proj.weight for layer in model.model.layers]
    names = fused.fuse(model)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(f"model.layers.{i}.mlp" in names for i in range(2))
    assert all(isinstance(m, PackedSwiGLUMLP) and m.gate_up_proj.weight is w for m, w in zip(mlps, weights))
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with _OpCounter() as ops:
        logits = model(ids).logits
    assert ops.count("linear_swiglu") == 2  # one packed GEMM + epilogue per layer
    torch.testing.assert_close(logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
    # SGD: GLM-4's key bias has an exactly-zero true gradient (softmax ignores a shift of every
    # score), whose rounding noise AdamW's normalisation would turn into steps of lr
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    assert train_losses(model, sgd(model.parameters()), 3, vocab=128) == pytest.approx(
        train_losses(plain, sgd(plain.parameters()), 3, vocab=128), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)


def test_packed_mlp_is_the_modules_math_in_float64():
    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=128, pad_token_id=0)
    torch.manual_seed(0)
    mlp = transformers.models.phi3.modeling_phi3.Phi3MLP(config).double()
    fused_mlp = PackedSwiGLUMLP(copy.deepcopy(mlp.gate_up_proj), copy.deepcopy(mlp.down_proj))
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = mlp(x), fused_mlp(x2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(y2, y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-14)
    for p, q in zip(fused_mlp.parameters(), mlp.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def _first_half_mlp(self, x):  # reads the gate half of the packed output only: a one-block split is wrong
    return self.down_proj(self.gate_up_proj(x)[..., :64])


def test_packed_mlps_are_split_block_by_block_not_gathered():
    # Phi-3 publishes its gate_up_proj "colwise_gather_output" with down_proj "rowwise_split_input"
    # (its forward chunks the output in two); split as two blocks, the chunk is this rank's gate and
    # up: no gather (Note [packed MLPs split block by block] in tensor_parallel/plan.py).
    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=128, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config)
    plan = published_plan(model)
    assert plan["model.layers.*.mlp.gate_up_proj"] == Column(fused=2) and plan["model.layers.*.mlp.down_proj"] == Row()
    assert plan["model.layers.*.self_attn.qkv_proj"] == Column(gather_output=True)  # attention slices by global heads
    mlp = tp_parallelize(model).model.layers[0].mlp
    assert isinstance(mlp, PackedSwiGLUMLP) and isinstance(mlp.down_proj, RowParallelLinear)
    assert mlp.gate_up_proj.fused_sizes == (64, 64) and not mlp.gate_up_proj.gather_output
    # a forward that is not the packed form keeps the published entries
    other = transformers.Phi3ForCausalLM(config)
    other.model.layers[0].mlp.__class__ = type("HalfPhi3MLP", (transformers.models.phi3.modeling_phi3.Phi3MLP,),
                                               {"forward": _first_half_mlp})
    assert published_plan(other)["model.layers.*.mlp.gate_up_proj"] == Column(gather_output=True)
    # a GeLU gate: split block by block (any elementwise activation), not fused
    config.hidden_act = "gelu"
    with pytest.warns(UserWarning, match=r"fuse: 1 Phi3MLP of transformers \S+ keep their own forward, unfused"):
        gelu = tp_parallelize(transformers.Phi3ForCausalLM(config)).model.layers[0].mlp
    assert type(gelu).__name__ == "Phi3MLP" and gelu.gate_up_proj.fused_sizes == (64, 64)


def test_packed_swiglu_mlp_refuses_what_it_cannot_compute():
    with pytest.raises(TypeError, match="PackedSwiGLUMLP: gate_up_proj and down_proj must be a ColumnParallelLinear "
                                        "and a RowParallelLinear, or two nn.Linear"):
        PackedSwiGLUMLP(nn.Linear(8, 15), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"must be a column layer of two equal blocks split on their own "
                                         r"\(fused_sizes=\(8, 8\)\)"):
        PackedSwiGLUMLP(ColumnParallelLinear(8, 16), RowParallelLinear(8, 8))
