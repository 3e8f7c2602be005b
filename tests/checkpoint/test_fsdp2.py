"""A checkpoint of the same Hugging Face Llama saved from FSDP2 + DTensor TP (`fully_shard` per
decoder layer + `parallelize_module`, dp=2 x tp=2, as torchtitan builds it, with its flattened
optimizer state dict) loads into our tp=2 x dp=2 ZeRO-3 layout, and ours loads into that:
parameters, AdamW moments and settings, bit for bit. Real gloo processes."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parallel_layers import checkpoint
from tests.checkpoint.test_dcp import _build, _full_state, _ids
from tests.dist_harness import run_distributed
from tests.hf._tiny import save_tiny_llama

transformers = pytest.importorskip("transformers")
LR = 3e-3  # FSDP2's; ours is built with another and must take this one from the checkpoint


def _fsdp2_tp(directory):
    """torchtitan's composition on a Llama: TP on the projections, then FSDP2 per decoder layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    plan = {}
    for i in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _fill(dtensor, full):
    """Write the global tensor `full` into a DTensor's local part."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    dtensor.to_local().copy_(full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def _state_dicts(model, opt):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(
                flatten_optimizer_state_dict=True))}


def _full(sd) -> dict:
    """Full tensors (as lists) of the model and of the AdamW moments, by name."""
    out = {f"model.{k}": v.full_tensor().tolist() for k, v in sd["model"].items()}
    for k, v in sd["optimizer"].items():
        if k.startswith("state.") and k.rsplit(".", 1)[1] in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.{k}"] = v.full_tensor().tolist()
    return out


def _fsdp2_save(rank, world, directory, path):
    model, opt = _fsdp2_tp(directory)
    for i, (name, p) in enumerate(model.named_parameters()):  # distinct gradients, then one step
        p.grad = torch.zeros_like(p)
        _fill(p.grad, torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    opt.step()
    sd = _state_dicts(model, opt)
    dcp.save(sd, checkpoint_id=path)
    return _full(sd)


def _ours_load_and_save(rank, world, directory, path, root):
    model, zero, opt, ctx = _build(directory, tp=2, dp=2, stage=3)
    assert checkpoint.load(path, zero, opt) == {}
    assert opt.param_groups[0]["lr"] == LR
    saved = checkpoint.save(root, 1, zero, opt)
    return saved, _full_state(model, zero, ctx)


def _read_full(path, names) -> dict:
    """Full tensors of `names` ("model.<key>", "optimizer.state.<key>.exp_avg") from a DCP checkpoint."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    flat = {n: torch.empty(tuple(md[n].size), dtype=md[n].properties.dtype) for n in names}
    nested = {}
    for n, t in flat.items():
        head, rest = n.split(".", 1)
        nested.setdefault(head, {})[rest] = t
    dcp.load(nested, checkpoint_id=path, no_dist=True)
    return flat


def test_fsdp2_tp_checkpoint_loads_into_ours_and_back(tmp_path):
    save_tiny_llama(tmp_path / "hf")
    hf, fsdp_path = str(tmp_path / "hf"), str(tmp_path / "fsdp2")
    want = run_distributed(_fsdp2_save, 4, args=(hf, fsdp_path), timeout_s=240)[0]
    saved, ours = run_distributed(_ours_load_and_save, 4, args=(hf, fsdp_path, str(tmp_path / "ours")),
                                  timeout_s=240)[0]
    for name, values in want.items():
        if name.startswith("model."):
            assert torch.tensor(ours[name[len("model."):]]).equal(torch.tensor(values)), name
    # Our checkpoint of what we loaded holds FSDP2's moments, bit for bit.
    again = _read_full(saved, list(want))
    for name, values in want.items():
        assert again[name].equal(torch.tensor(values)), name


def _ours_train_and_save(rank, world, directory, root):
    model, zero, opt, ctx = _build(directory, tp=2, dp=2, stage=3)
    ids = _ids(7).chunk(2)[ctx.coordinate("dp")]
    zero(input_ids=ids, labels=ids).loss.backward()
    zero.step()
    for group in opt.param_groups:
        group["lr"] = LR
    return checkpoint.save(root, 1, zero, opt)


def _fsdp2_load(rank, world, directory, path):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    model, opt = _fsdp2_tp(directory)
    for group in opt.param_groups:
        group["lr"] = 0.5
    sd = _state_dicts(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optimizer"], options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert opt.param_groups[0]["lr"] == LR
    return _full(_state_dicts(model, opt))


def test_our_checkpoint_loads_into_fsdp2_tp(tmp_path):
    save_tiny_llama(tmp_path / "hf")
    hf = str(tmp_path / "hf")
    path = run_distributed(_ours_train_and_save, 4, args=(hf, str(tmp_path / "ours")), timeout_s=240)[0]
    got = run_distributed(_fsdp2_load, 4, args=(hf, path), timeout_s=240)[0]
    want = _read_full(path, list(got))
    assert len(want) > 20
    for name, values in got.items():
        assert torch.tensor(values).equal(want[name]), name
