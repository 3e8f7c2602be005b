"""Models that `peft` adapted (LoRA and its kin): what the layouts do with them.

Note [peft models]: `peft.get_peft_model(model, config)` wraps a transformers model in a
PeftModel and replaces each targeted linear layer by a peft layer holding the frozen original
(`base_layer`) beside the small trainable adapter matrices (`lora_A`, `lora_B`). Data
parallelism (DataParallel, ZeRO 1-3) treats them as any parameters: they match the peft model
trained in one process (review finding, helper-47). What does not hold for them:

  - tensor parallelism splits a LoRA layer's base and adapters together (the adapter's A with
    a row layer's input, its B with a column layer's output: Note [LoRA under tensor
    parallelism] in tensor_parallel/lora.py), on the transformers model inside the wrapper (the
    plan names its modules: with the PeftModel's own names, `base_model.model.model.layers...`,
    the published plan once matched nothing and every rank trained the whole model, silently).
    peft's other layers named by the plan are refused.
  - pipeline_layers="auto" cuts a transformers model's own modules; the PeftModel wrapper is
    not one (its base model, with the LoRA layers inside, is: parallelize(peft_model
    .get_base_model(), ...)).
  - hf.save_pretrained writes the transformers model's names or, for the PeftModel wrapper, the
    adapter as peft's own save does; the base model with LoRA layers inside is neither
    (merge_and_unload() first, or pass the wrapper). hf.load_pretrained reads a LoRA layer's
    `base_layer.weight` under the transformers model's name and gives meta-built adapters
    peft's initialization (Note [adapters built on the meta device]).
  - adapters added after parallelize: no optimizer, gradient bucket or ZeRO unit holds them, so
    they never trained (Parallelized.step refuses: `new_trainable`).

Detected by the classes' module (peft is not a dependency: nothing here imports it).
"""

from __future__ import annotations

import dataclasses
import types
import zlib

import torch
import torch.nn as nn


def _from_peft(module: nn.Module) -> bool:
    # a class of peft's, or derived from one (a LoRA layer under tensor parallelism,
    # tensor_parallel/lora.py)
    return any(c.__module__.split(".")[0] == "peft" for c in type(module).__mro__)


def peft_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of `model` that peft made, the wrapper included."""
    return [(name or "<the model>", m) for name, m in model.named_modules() if _from_peft(m)]


def describe(found: list[tuple[str, nn.Module]]) -> str:
    """The adapted layers (those holding their original as base_layer), else peft's modules."""
    layers = [(n, m) for n, m in found if isinstance(getattr(m, "base_layer", None), nn.Module)] or found
    kind = "layer(s) adapted by peft" if layers is not found else "module(s) made by peft"
    name, m = layers[0]
    return f"{len(layers)} {kind}, e.g. {name} ({type(m).__module__}.{type(m).__qualname__})"


def is_wrapper(model: nn.Module) -> bool:
    """peft's PeftModel (or a subclass): the wrapper around the transformers model it adapts."""
    return _from_peft(model) and callable(getattr(type(model), "get_base_model", None))


def tensor_parallel_refusal(name: str, module: nn.Module) -> str | None:
    """Why tensor parallelism cannot split the peft module `module` the plan names, or None for
    a module peft did not make or a LoRA layer (tensor_parallel/lora.py checks those)."""
    if not _from_peft(module) or is_lora_layer(module):
        return None
    return (f"parallelize: the plan splits {name}, which is peft's {type(module).__qualname__}; tensor parallelism "
            f"splits LoRA layers (and the modules peft left alone) only. Train this peft model with data parallelism "
            f"(zero_stage=0 for DataParallel, or ZeRO 1-3), or leave {name} out of the plan")


def refuse_wrapper(model: nn.Module, what: str, fix: str) -> None:
    """The PeftModel wrapper itself where a transformers model's own modules are needed."""
    if is_wrapper(model):
        base = type(model.get_base_model()).__name__
        raise ValueError(f"{what} needs a transformers model's own modules; {type(model).__name__} is peft's wrapper "
                         f"around a {base}: {fix}")


def adapted_wrapper(model: nn.Module, what: str) -> str | None:
    """How hf.save_pretrained writes `model`: "wrapper" for peft's wrapper (its adapter, as
    peft's save writes it); "base" for the transformers model inside it, holding its LoRA layers
    and peft's configs (a pipeline over the base model: the adapter, through a wrapper rebuilt
    around the gathered state, `rewrapped`); None for a model peft did not touch. Refuses peft's
    layers without their configs, whose names are neither the transformers model's nor an
    adapter's."""
    if is_wrapper(model):
        return "wrapper"
    found = peft_modules(model)
    if found and isinstance(getattr(model, "peft_config", None), dict) and model.peft_config:
        return "base"
    if found:
        raise ValueError(f"{what}: {type(model).__name__} holds {describe(found)}, without peft's wrapper: its "
                         f"weights are under neither the transformers model's names nor an adapter's. Pass the "
                         f"PeftModel that get_peft_model returned (its adapter is written, as peft's save_pretrained "
                         f"does), or merge_and_unload() it first")
    return None


def rewrapped(base: nn.Module, state: dict) -> nn.Module:
    """A PeftModel around a copy of `base` (a transformers model that holds peft's LoRA layers
    and their configs) built on the meta device and given `state` - the base model's whole
    state, gathered from any layout: what peft's own save_pretrained writes the adapter from."""
    import copy

    import peft

    with torch.device("meta"):
        plain = type(base)(copy.deepcopy(base.config))
    (first, config), *rest = base.peft_config.items()
    model = peft.get_peft_model(plain, copy.deepcopy(config), adapter_name=first)
    for name, other in rest:
        model.add_adapter(name, copy.deepcopy(other))
    prefix = next(name for name, m in model.named_modules() if m is model.get_base_model()) + "."
    model.load_state_dict({prefix + k: v for k, v in state.items()}, strict=True, assign=True)
    return model


# Note [adapters built on the meta device]: a model too large for one device is built on the meta
# device, adapted there (get_peft_model puts the adapters beside their base layers: meta too),
# parallelized, then filled from its files (hf.load_pretrained). The files hold the transformers
# model's tensors: a LoRA layer's `base_layer.weight` is read under the layer's own name
# (`q_proj.weight`), a `modules_to_save` copy and its original both under the wrapped module's.
# The adapters are in no file: where they are on the meta device they get what get_peft_model
# gives them on a real device - each layer's lora_A / lora_B built as peft's update_layer builds
# them (nn.Linear's default initialization; an embedding's from torch.randn), then peft's own
# `reset_lora_parameters` for the config's init_lora_weights (True: kaiming-uniform A, zero B;
# "gaussian"; False leaves the defaults) - on a full-size CPU twin of the adapter (r x features:
# small), of which each rank copies the boxes it holds. The random generator is seeded per layer
# from one seed (rank 0's, or the caller's) and the layer's name in the transformers model, so
# every rank and every layout draws the same adapters, and an unparallelized model loaded the
# same way is the reference a parallel one is checked against. Initializations that read the
# base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...) and DoRA's magnitude (the base weight's
# norms) cannot be computed before the weights are read: refused, naming the way that works
# (load first, then get_peft_model).
_INITS = (True, False, "gaussian")  # what reset_lora_parameters computes without the base weights
_KINDS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")  # the tensors a twin holds


def is_lora_layer(module: nn.Module) -> bool:
    return _from_peft(module) and any(c.__name__ == "LoraLayer" for c in type(module).__mro__)


def is_saved_copy(module: nn.Module) -> bool:  # peft's ModulesToSaveWrapper: a trainable copy of a module
    return _from_peft(module) and isinstance(getattr(module, "original_module", None), nn.Module) and \
        isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)


@dataclasses.dataclass
class Adapted:
    """A transformers model, possibly adapted by peft, as hf.load_pretrained reads it: `model` is
    the transformers model (inside peft's wrapper, if any), `prefix` its path in the names held
    ("base_model.model." under the wrapper), `layers` the peft modules that hold a file's tensor
    under another name, by path. For a model peft did not touch: the model itself, no layers."""
    model: nn.Module
    prefix: str
    layers: dict[str, nn.Module]
    configs: dict

    def file_name(self, name: str) -> str | None:
        """The transformers model's name of the held tensor `name`: a LoRA layer's base weight
        under the layer's name; None for an adapter's tensor (in no file)."""
        done = set()  # each layer once: its own name starts with its path too
        while True:
            path = self._layer_path(name, done)
            if path is None:
                break
            done.add(path)
            layer, rest = self.layers[path], name[len(path) + 1:]
            if is_lora_layer(layer):
                if not rest.startswith("base_layer."):
                    return None
                name = f"{path}.{rest[len('base_layer.'):]}"
            else:  # modules_to_save: the original and each adapter's trainable copy start as the module
                head, _, tail = rest.partition(".")
                if head == "modules_to_save":
                    tail = tail.partition(".")[2]
                name = f"{path}.{tail}"
        return name[len(self.prefix):] if name.startswith(self.prefix) else name

    def check_initializable(self, names: list[str], what: str) -> None:
        """Refuse adapters on the meta device that peft initializes from the base weights, or of
        a kind built here from no recipe (Note [adapters built on the meta device])."""
        for name in names:
            layer, adapter, path = self._owner(name)
            kind = name[len(path) + 1:].partition(".")[0]
            if not is_lora_layer(layer) or kind not in _KINDS:
                raise ValueError(f"{what}: {name} belongs to {type(layer).__qualname__} made by peft, and is on the meta "
                                 f"device; hf.load_pretrained initializes LoRA's {', '.join(_KINDS)} only. {_LOAD_FIRST}")
            config = self.configs.get(adapter)
            init = getattr(config, "init_lora_weights", True)
            if getattr(config, "use_dora", False):
                raise ValueError(f"{what}: adapter {adapter!r} uses DoRA (use_dora=True), whose magnitude is the base "
                                 f"weights' norms, and {name} is on the meta device: it cannot be computed before the "
                                 f"weights are read. {_LOAD_FIRST}")
            if not any(init is ok or (isinstance(init, str) and isinstance(ok, str) and init.lower() == ok)
                       for ok in _INITS):
                raise ValueError(f"{what}: adapter {adapter!r} has init_lora_weights={init!r}, which peft computes from "
                                 f"the base layer's weights, and {name} is on the meta device; hf.load_pretrained "
                                 f"initializes meta adapters as init_lora_weights=True, False or 'gaussian' do. "
                                 f"{_LOAD_FIRST}")

    def initial_values(self, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
        """The initial value of each adapter tensor in `shapes` (name -> full shape), on the CPU
        (Note [adapters built on the meta device])."""
        wanted: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
        for name, shape in shapes.items():
            _, adapter, path = self._owner(name)
            wanted.setdefault((path, adapter), {})[name[len(path) + 1:]] = tuple(shape)
        values = {}
        for (path, adapter), held in sorted(wanted.items()):
            layer = self.layers[path]
            init = getattr(self.configs.get(adapter), "init_lora_weights", True)
            plain = path[len(self.prefix):] if path.startswith(self.prefix) else path
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed + zlib.crc32(f"{plain}/{adapter}".encode())) % 2**63)
                twin = _twin(layer, adapter, held)
                if init is not False:
                    type(layer).reset_lora_parameters(twin, adapter, init)
            for rest in held:
                kind, _, field = rest.partition(f".{adapter}")
                table = getattr(twin, kind)[adapter]
                values[f"{path}.{rest}"] = (getattr(table, field[1:]) if field else table).detach()
        return values

    def _owner(self, name: str) -> tuple[nn.Module, str, str]:
        path = self._layer_path(name)
        parts = name[len(path) + 1:].split(".")
        return self.layers[path], parts[1] if len(parts) > 1 else "", path

    def _layer_path(self, name: str, skip: set = frozenset()) -> str | None:
        """The innermost peft layer holding the tensor `name` (not in `skip`): its dotted prefixes,
        longest first, looked up (a model's thousands of tensors against hundreds of layers)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:i])
            if path in self.layers and path not in skip:
                return path
        return None


_LOAD_FIRST = ("Build the model on a real device and load it first (hf.load_pretrained into the model built without "
               "adapters, or from_pretrained), then apply get_peft_model before parallelize")


def _twin(layer: nn.Module, adapter: str, held: dict[str, tuple[int, ...]]) -> types.SimpleNamespace:
    """The adapter tensors of `layer` as peft's update_layer builds them, full size on the CPU,
    under the attributes its reset_lora_parameters reads. `held` has the shape of each of the
    layer's tensors of `adapter` (a rank describes every tensor of a layer it holds: ZeRO's
    with no piece too)."""
    twin = types.SimpleNamespace(lora_A={}, lora_B={}, lora_embedding_A={}, lora_embedding_B={},
                                 r=layer.r, lora_bias=layer.lora_bias, get_base_layer=lambda: None)
    if adapter in layer.lora_A:
        r, fan_in = held[f"lora_A.{adapter}.weight"]
        out, _ = held[f"lora_B.{adapter}.weight"]
        twin.lora_A[adapter] = nn.Linear(fan_in, r, bias=False)
        twin.lora_B[adapter] = nn.Linear(r, out, bias=getattr(layer.lora_B[adapter], "bias", None) is not None)
    if adapter in layer.lora_embedding_A:
        twin.lora_embedding_A[adapter] = nn.Parameter(torch.randn(held[f"lora_embedding_A.{adapter}"]))
        twin.lora_embedding_B[adapter] = nn.Parameter(torch.randn(held[f"lora_embedding_B.{adapter}"]))
    return twin


def adapted(hf_model: nn.Module) -> Adapted:
    """hf_model (what _hf_model found: a transformers model, or peft's wrapper around one) as
    hf.load_pretrained reads it."""
    model, prefix = hf_model, ""
    if is_wrapper(hf_model):
        model = hf_model.get_base_model()
        prefix = next(name for name, m in hf_model.named_modules() if m is model) + "."
    layers = {name: m for name, m in hf_model.named_modules() if is_lora_layer(m) or is_saved_copy(m)}
    configs = getattr(hf_model, "peft_config", None) or getattr(model, "peft_config", None) or {}
    return Adapted(model, prefix, layers, dict(configs))
