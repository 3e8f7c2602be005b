"""Data-parallel wrappers over a Hugging Face model loaded with `from_pretrained` (its
parameters live in the memory-mapped safetensors file), against the same model trained in
one process: losses and parameters after several AdamW steps (SGD for GPT-2, whose key bias
has an exactly-zero true gradient that Adam would blow up from rounding noise). GPT-2 under
ZeRO-3 with the default wrap: its head reads the embedding's weight after the transformer's
forward (Note [shared parameters] in zero/api.py). DataParallel and ZeRO-3 run the Llama with
its MLPs fused (parallel_layers/fused.py), as `parallelize` does: the MLP's input gradient has
no collective of its own, and ZeRO-3 keeps the packed gate and up weights in one allocation
(both in their decoder layer's group), freed between uses and read as one view when gathered."""

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf._tiny import save_tiny_gpt2, save_tiny_llama

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 3, 4, 16


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (BATCH, SEQ), generator=g) for _ in range(STEPS)]  # both vocabularies


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _train(rank, world, directory, wrapper):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from parallel_layers import DataParallel, ZeRO, fused

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert not next(model.parameters()).untyped_storage().resizable()  # the premise: memory-mapped
    if wrapper in ("dp", "zero3"):  # as parallelize runs them: fused MLPs, gate and up in one allocation
        assert fused.fuse(model)
    if wrapper == "dp":
        wrapped = DataParallel(model)
        opt = _adamw(model.parameters())
    elif wrapper == "gpt2-zero3-default-wrap":
        wrapped = opt = ZeRO(model, _sgd, stage=3)
    else:
        wrapped = ZeRO(model, _adamw, stage=int(wrapper[-1]), wrap=lambda m: isinstance(m, LlamaDecoderLayer))
        opt = wrapped
    packed = []  # ZeRO-3: gate and up keep one allocation (both in their layer's group), freed between uses
    if wrapper == "zero3":
        from parallel_layers.tensor_parallel.layers import _adjacent

        for layer in model.model.layers:
            gate, up = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
            assert gate.untyped_storage()._cdata == up.untyped_storage()._cdata  # one StorageImpl
            assert gate.untyped_storage().nbytes() == 0  # freed
            layer.mlp.register_forward_pre_hook(lambda m, _: packed.append(
                _adjacent(m.gate_proj.weight, m.up_proj.weight) and m.gate_proj.weight.untyped_storage().nbytes()))
    losses = []
    for ids in _batches():
        mine = ids.chunk(world)[rank]  # equal token counts: the mean of the ranks' means is the batch mean
        loss = wrapped(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    if wrapper == "zero3":  # every forward read [gate; up] as a view of the gathered storage, no copy
        gate = model.model.layers[0].mlp.gate_proj.weight
        assert len(packed) == STEPS * len(model.model.layers) and all(n == 2 * gate.numel() * 4 for n in packed)
    state = wrapped.full_state_dict() if wrapper != "dp" else model.state_dict()
    return losses, {k: v.tolist() for k, v in state.items()}  # plain lists cross the process pipe


def _reference(directory, optimizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    opt = optimizer(model.parameters())
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("wrapper", ["dp", "zero1", "zero2", "zero3", "gpt2-zero3-default-wrap"])
def test_from_pretrained_model_matches_one_process(tmp_path, wrapper):
    gpt2 = wrapper.startswith("gpt2")
    (save_tiny_gpt2 if gpt2 else save_tiny_llama)(tmp_path)
    ref_losses, ref_state = _reference(tmp_path, _sgd if gpt2 else _adamw)
    for losses, state in run_distributed(_train, 2, args=(str(tmp_path), wrapper), timeout_s=240):
        # float32; only the order of sums differs (two half batches averaged vs one batch):
        # ~1e-7 relative per step, amplified by AdamW's normalisation over 3 steps to ~1e-6.
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            assert torch.allclose(torch.tensor(state[name]), ref, rtol=1e-4, atol=1e-5), name
