"""Models that `peft` adapted (LoRA and its kin): what the layouts do with them.

Note [peft models]: `peft.get_peft_model(model, config)` wraps a transformers model in a
PeftModel and replaces each targeted linear layer by a peft layer holding the frozen original
(`base_layer`) beside the small trainable adapter matrices (`lora_A`, `lora_B`). Data
parallelism (DataParallel, ZeRO 1-3) treats them as any parameters: they match the peft model
trained in one process (review finding, helper-47). What does not hold for them:

  - tensor parallelism splits nn.Linear / Conv1D layers; a LoRA layer's base and adapters
    would have to be split together (the adapter's A with a row layer's input, its B with a
    column layer's output), which nothing here does. With the published plan the PeftModel's
    own module names (`base_model.model.model.layers...`) matched none of its patterns, so
    tp=2 converted nothing and every rank trained the whole model, silently: refused.
  - pipeline_layers="auto" cuts a transformers model's own modules; the PeftModel wrapper is
    not one (its base model, with the LoRA layers inside, is: parallelize(peft_model
    .get_base_model(), ...)).
  - hf.save_pretrained / load_pretrained write and read the transformers model's names; a
    LoRA layer's `base_layer.weight` is not one of them (merge_and_unload() first, or export
    the adapter with peft).
  - adapters added after parallelize: no optimizer, gradient bucket or ZeRO unit holds them, so
    they never trained (Parallelized.step refuses: `new_trainable`).

Detected by the classes' module (peft is not a dependency: nothing here imports it).
"""

from __future__ import annotations

import torch.nn as nn


def _from_peft(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def peft_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of `model` that peft made, the wrapper included."""
    return [(name or "<the model>", m) for name, m in model.named_modules() if _from_peft(m)]


def describe(found: list[tuple[str, nn.Module]]) -> str:
    """The adapted layers (those holding their original as base_layer), else peft's modules."""
    layers = [(n, m) for n, m in found if isinstance(getattr(m, "base_layer", None), nn.Module)] or found
    kind = "layer(s) adapted by peft" if layers is not found else "module(s) made by peft"
    name, m = layers[0]
    return f"{len(layers)} {kind}, e.g. {name} ({type(m).__module__}.{type(m).__qualname__})"


def refuse_tensor_parallel(model: nn.Module) -> None:
    """Tensor parallelism does not split peft's layers (Note [peft models])."""
    found = peft_modules(model)
    if found:
        raise ValueError(
            f"parallelize: tensor parallelism does not split peft's adapted layers, and {type(model).__name__} holds "
            f"{describe(found)}. Train a peft model with data parallelism (zero_stage=0 for DataParallel, or ZeRO "
            f"1-3) and/or a pipeline over its base model (parallelize(peft_model.get_base_model(), ctx, "
            f"pipeline_layers='auto', ...)), or merge_and_unload() it first to train every weight under tensor "
            f"parallelism")


def refuse_wrapper(model: nn.Module, what: str, fix: str) -> None:
    """The PeftModel wrapper itself where a transformers model's own modules are needed."""
    if _from_peft(model) and callable(getattr(type(model), "get_base_model", None)):
        base = type(model.get_base_model()).__name__
        raise ValueError(f"{what} needs a transformers model's own modules; {type(model).__name__} is peft's wrapper "
                         f"around a {base}: {fix}")


def adapted_wrapper(model: nn.Module, what: str) -> bool:
    """True if `model` is peft's wrapper (hf.save_pretrained writes its adapter, as peft does);
    False for a model peft did not touch; refuses peft's layers without their wrapper (the
    base model of a PeftModel), whose names are neither the transformers model's nor the
    adapter's."""
    if _from_peft(model) and callable(getattr(type(model), "get_base_model", None)):
        return True
    found = peft_modules(model)
    if found:
        raise ValueError(f"{what}: {type(model).__name__} holds {describe(found)}, without peft's wrapper: its "
                         f"weights are under neither the transformers model's names nor an adapter's. Pass the "
                         f"PeftModel that get_peft_model returned (its adapter is written, as peft's save_pretrained "
                         f"does), or merge_and_unload() it first")
    return False


def refuse_loading(model: nn.Module, what: str) -> None:
    """hf.load_pretrained fills a transformers model's own tensors from its files."""
    found = peft_modules(model)
    if found:
        raise ValueError(f"{what} fills a transformers model's tensors from its weight files; {type(model).__name__} "
                         f"holds {describe(found)}, whose adapters the files do not hold. Load the model first "
                         f"(hf.load_pretrained into the model built without adapters, or from_pretrained), then "
                         f"apply get_peft_model before parallelize")
