"""Hugging Face models in and out of any layout.

    hf.save_pretrained(model, "export/")        # every rank; any layout (TP, ZeRO, DataParallel)
    transformers.AutoModelForCausalLM.from_pretrained("export/")   # the plain model, same logits

Export goes through the checkpoint code (parallel_layers.checkpoint), which already turns every
layout into the unparallelized tensors: the ranks write their pieces as a temporary DCP
checkpoint inside `directory`, rank 0 reads it back whole (the plain model's state_dict: a
GPT-2 Conv1D weight that `parallelize` holds [out, in] is [in, out] there, Note [transposed
weights] in placement.py), and lets transformers write config and safetensors (tied weights
once, shards as transformers cuts them). Rank 0 holds the full model in host memory while writing, as
transformers' own save does.

Loading, the other way (docs/hf.md):

    with torch.device("meta"):                  # no memory: the sizes that need TP and ZeRO-3
        model = transformers.AutoModelForCausalLM.from_config(config)
    par = parallelize(model, ctx, tp_plan="auto", zero_stage=3, ...)   # or any layout
    hf.load_pretrained("llama/", par)            # every rank reads only the slices it holds

`load_pretrained` asks `placement.describe` what this rank holds - for every logical tensor
(the plain model's state_dict entry), the boxes of it in the local tensor: a TP shard, the
blocks of a fused QKV, a vocabulary shard without its padding, the boxes a ZeRO flat shard
covers (Note [flat pieces]) - and reads exactly those boxes with safetensors' `get_slice`,
so a rank's reads and memory are its share of the model, not the model. Meta tensors get
storage first (parallel_layers/meta.py). GPT-2's Conv1D weights are [in, out] in the files and
in the placement alike; a piece of a weight that `parallelize` made [out, in] is a transposed
view of it. A pipeline rank holds
its stages only, under the Hugging Face names; the last stage's copy of a head tied to the
input embedding is found in the files under the tie's other name.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import shutil
import warnings

import torch
import torch.nn as nn

from parallel_layers import _peft, checkpoint, meta, placement
from parallel_layers.checkpoint._dist import all_gather, broadcast, describe_error, raise_if_any, rank_world


def _hf_model(model: nn.Module, what: str = "hf.save_pretrained") -> nn.Module:
    """The transformers model inside wrappers (ZeRO, DataParallel, DDP, PipelineStages)."""
    seen = model
    while not hasattr(seen, "config") and hasattr(seen, "module"):
        seen = seen.module
    if getattr(seen, "named_after", None) is not None:  # the stages of pipeline_layers="auto" (pipeline/hf.py)
        seen = seen.named_after
    if not hasattr(seen, "config") or not hasattr(seen, "save_pretrained"):
        raise TypeError(f"{what} needs a transformers model (with .config), possibly wrapped by ZeRO or "
                        f"DataParallel; got {type(model).__name__}")
    return seen


def _checked(state: dict[str, torch.Tensor], plain: nn.Module) -> dict[str, torch.Tensor]:
    """`state`, if its keys and shapes are the plain model's."""
    expected = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise KeyError(f"hf.save_pretrained: the model's tensors do not match {type(plain).__name__}'s: missing "
                       f"{missing[:5]}, unexpected {unexpected[:5]}")
    out = {}
    for key, value in state.items():
        if tuple(value.shape) != expected[key]:
            raise ValueError(f"hf.save_pretrained: {key} is {tuple(value.shape)}, {type(plain).__name__} expects "
                             f"{expected[key]}")
        out[key] = value
    return out


def save_pretrained(model: nn.Module, directory: str, *, group=None, dtype: torch.dtype | None = None,
                    max_shard_size: int | str | None = None) -> str:
    """Write `model` (this rank's part of a transformers model, at any layout, or the
    `Parallelized` of `parallelize`) as a directory that
    `transformers.AutoModelForCausalLM.from_pretrained(directory)` loads; a collective.
    dtype: cast the weights (default: as held; ZeRO's float32 masters for ZeRO parameters, a
    parameter frozen when ZeRO was built in its own dtype).
    max_shard_size: transformers' (files of at most this size and an index; default its own).
    Weight files an earlier save left in `directory` that this one did not write are removed
    (Note [stale weight files])."""
    model = _unwrap(model)[0]
    hf_model = _hf_model(model)
    adapted = _peft.adapted_wrapper(hf_model, "hf.save_pretrained")  # Note [peft models]
    rank, _ = rank_world(group)
    staging = os.path.join(directory, ".parallel_layers-export")
    written = os.path.join(directory, ".parallel_layers-export-files")  # transformers writes here first
    path = checkpoint.save(staging, 0, model, group=group)
    err = None
    if rank == 0:
        try:
            state = checkpoint.export_state_dict(path)
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            shutil.rmtree(written, ignore_errors=True)  # a killed export's leftovers would be moved in too
            if adapted == "wrapper":  # the adapter, as peft's own save writes it from the whole state (Note [peft models])
                hf_model.save_pretrained(written, state_dict=state)
            elif adapted == "base":  # a pipeline over the base model: a wrapper rebuilt around the whole state
                _peft.rewrapped(hf_model, state).save_pretrained(written, selected_adapters=list(hf_model.peft_config))
            else:
                with torch.device("meta"):  # a copy: transformers' save writes config.dtype into the config
                    plain = type(hf_model)(copy.deepcopy(hf_model.config))  # (the user's, on rank 0 only)
                plain.load_state_dict(_checked(state, plain), strict=True, assign=True)
                plain.tie_weights()
                if getattr(hf_model, "generation_config", None) is not None:  # the model's own (sampling settings),
                    plain.generation_config = copy.deepcopy(hf_model.generation_config)  # not one from its config
                plain.save_pretrained(written, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
            _move_export(written, directory, _ADAPTER_FILE if adapted else _WEIGHT_FILE)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = describe_error(e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(written, ignore_errors=True)
    err = broadcast(err, group)
    if err is not None:
        raise RuntimeError(f"hf.save_pretrained: rank 0 could not write {directory!r}: {err}")
    return directory


SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")
_ADAPTER_FILE = re.compile(r"^adapter_model\.(safetensors|bin)$")  # what peft writes beside adapter_config.json


# Note [stale weight files]: transformers' save_pretrained removes the shards of an earlier save
# into the same directory but not its index: exporting a model as one model.safetensors over a
# sharded save left model.safetensors.index.json naming files no longer there, which readers that
# take the index first (hf.load_pretrained did; vLLM filters weight files by it) then failed on
# or read wrongly (review finding). So transformers writes into an empty directory beside the
# staging checkpoint, and the files it wrote replace their namesakes in `directory`, where a
# weight file (model*.safetensors, the index) it did not write is removed first - decided by
# name (a first version compared inode, size and mtime, which a second save of the same model
# within a file system's mtime granularity can leave unchanged: review finding). Other files
# there (a tokenizer's) stay.
def _move_export(written: str, directory: str, weight_file: re.Pattern = _WEIGHT_FILE) -> None:
    names = set(os.listdir(written))
    for name in os.listdir(directory):
        if weight_file.match(name) and name not in names:
            os.remove(os.path.join(directory, name))
    for name in sorted(names):
        target = os.path.join(directory, name)
        if os.path.isdir(target) and not os.path.islink(target):  # peft's folder of a second adapter: this
            shutil.rmtree(target)  # save's replaces the last one's (os.replace refuses a non-empty one; helper-64)
        os.replace(os.path.join(written, name), target)


def _weight_files(directory: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it: one `model.safetensors`, else the files
    of a sharded `model.safetensors.index.json` (transformers' names and order)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"hf.load_pretrained: {directory!r} is not a directory")
    # transformers' order: a model.safetensors first, then the index
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"hf.load_pretrained: {index} has no 'weight_map' (tensor name -> file name)")
        files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        absent = sorted({os.path.basename(f) for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise FileNotFoundError(f"hf.load_pretrained: {index} names files that {directory!r} does not hold: "
                                    f"{absent[:5]}")
        return files
    raise FileNotFoundError(f"hf.load_pretrained: {directory!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it "
                            f"holds {sorted(os.listdir(directory))[:10]}); write it with transformers' "
                            "save_pretrained, whose default format is safetensors")


def _file_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the files, from their headers (no tensor data is read)."""
    from safetensors import safe_open
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            held = set(f.keys())
            for name in (n for n, p in files.items() if p == path):
                if name not in held:
                    raise KeyError(f"hf.load_pretrained: the index puts {name!r} in {os.path.basename(path)}, which "
                                   "does not hold it")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


# Note [buffers not in the files]: a buffer registered with persistent=False (the rotary
# embedding's `inv_freq` and `original_inv_freq` in Llama, Qwen2, Mistral) is in no checkpoint;
# transformers' from_pretrained recomputes it (its `_init_weights` of rotary modules). A model
# built on the meta device has none, and a wrong one would break parity silently. We take the
# values the model's own constructor computes: the unparallelized class is built once more
# from its config with every parameter sent to the meta device as it is registered (nothing
# of the weights is allocated) and the buffers real (small: O(head_dim) here), and each buffer
# the files do not hold is copied from it, cast to the dtype the model holds it in.
@contextlib.contextmanager
def _parameters_on_meta():
    """Inside: parameters move to the meta device as modules register them; buffers stay on
    the CPU, where their constructor computes them. Not thread-safe (it patches nn.Module)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        with torch.device("cpu"):  # whatever default device the caller set (meta, say)
            yield
    finally:
        nn.Module.register_parameter = register


def _reference(hf_model: nn.Module) -> nn.Module:
    """The unparallelized model's structure and buffers, its parameters on the meta device."""
    with _parameters_on_meta():
        return type(hf_model)(hf_model.config)


def _unwrap(model) -> tuple[nn.Module, torch.device | None]:
    """(the module to load into, the device of its context) for a module or a `Parallelized`
    (with a pipeline: this rank's stages, possibly inside ZeRO or DataParallel)."""
    from parallel_layers.parallelize import Parallelized
    if isinstance(model, Parallelized):
        return model.module, model.ctx.device
    return model, None


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A model tensor that transformers stacks from per-expert tensors of the files (Note
    [experts stacked at load]): keys[j][e] is source pattern j's tensor for expert e; the
    patterns' stacks are concatenated along `dim` of the model's tensor (None: one pattern)."""
    keys: tuple[tuple[str, ...], ...]
    dim: int | None
    sizes: tuple[int, ...]  # each pattern's extent along `dim`
    shape: tuple[int, ...]  # the model tensor's


@dataclasses.dataclass
class _Source:
    """Where one logical tensor comes from: a name in the files (read as boxes); per-expert
    tensors of the files, stacked;
    nowhere, for a tied entry written through the other name of its tensor; the reference
    model, for a buffer the files lack; or peft's initialization, for an adapter."""
    key: str | None
    from_reference: bool = False
    stacked: _Stacked | None = None
    adapter: bool = False  # a peft adapter's tensor (Note [adapters built on the meta device] in _peft.py)

    def file_keys(self) -> set[str]:
        if self.stacked is not None:
            return {k for keys in self.stacked.keys for k in keys}
        return {self.key} if self.key is not None else set()


def _names_by_tensor(reference: nn.Module) -> list[list[str]]:
    """Every name of each parameter: a tied one has several (GPT-2's lm_head.weight and
    transformer.wte.weight)."""
    names_of: dict[int, list[str]] = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return list(names_of.values())


def _candidates(name: str, base: str) -> list[str]:
    """The keys under which the files may hold the model's `name`: itself; without the base
    model's prefix (a base model's files, "embed_tokens.weight", into a model with a head); with
    it (a model with a head's files, "model.embed_tokens.weight", into the base model), as
    transformers' from_pretrained reads both."""
    if not base:
        return [name]
    return [name, name[len(base) + 1:] if name.startswith(base + ".") else f"{base}.{name}"]


def _plan_sources(described: placement.ModelPlacement, adapted: _peft.Adapted, reference: nn.Module,
                  shapes: dict[str, tuple[int, ...]], files: dict[str, str]) -> dict[str, _Source]:
    """For every tensor this rank holds, where it comes from; raises naming every missing key
    and every shape that does not match. Held names are the transformers model's, through peft's
    layers (`adapted.file_name`; Note [adapters built on the meta device] in _peft.py)."""
    ref_buffers = dict(reference.named_buffers())
    base = getattr(adapted.model, "base_model_prefix", "")
    by_local: dict[int, list[str]] = {}
    for name, tp in described.tensors.items():
        by_local.setdefault(id(tp.local), []).append(name)
    # The other names of a tied parameter: a pipeline stage may hold a tie under the name the
    # files dropped (the last stage's lm_head.weight, where the files keep the embedding's).
    aliases = {name: names for names in _names_by_tensor(reference) for name in names}

    renamed, stacked, converted, unstacked = _checkpoint_renamings(reference, shapes)

    def in_files(name):  # transformers also reads a base model's files into a model with a head, and the reverse
        name = adapted.file_name(name)
        for alias in aliases.get(name, [name]):
            for candidate in _candidates(alias, base):
                if candidate in shapes or candidate in stacked:
                    return candidate
                if candidate in renamed:
                    return renamed[candidate]
        return None

    sources, missing, wrong = {}, [], []
    for names in by_local.values():
        if all(adapted.file_name(n) is None for n in names):  # an adapter's tensor: in no file
            sources.update({n: _Source(None, adapter=True) for n in names})
            continue
        # Tied entries (GPT-2's lm_head.weight is transformer.wte.weight) share one local
        # tensor; the files hold the tie once, under whichever name transformers kept.
        found = next(((n, k) for n in names for k in [in_files(n)] if k is not None), None)
        if found is None:
            if all(adapted.file_name(n) in ref_buffers for n in names):  # a persistent buffer the files lack
                sources.update({n: _Source(None, from_reference=True) for n in names})
            else:
                missing.extend(names)
            continue
        name, key = found
        expected = tuple(described.tensors[name].shape)
        held = stacked[key].shape if key in stacked else shapes[key]
        if held != expected:
            where = os.path.basename(files[key]) if key in files else "the files' per-expert tensors, stacked"
            wrong.append(f"{key}: {held} in {where}, the model's {name} expects {expected}")
        sources[name] = _Source(key, stacked=stacked.get(key))
        sources.update({n: _Source(None) for n in names if n != name})  # written through `name`'s local
    if missing:
        why = "".join(f"; the per-expert tensors of {name} do not stack: {reason}"
                      for name, reason in list(unstacked.items())[:3])
        if converted:
            why += (f"; transformers converts {len(converted)} of the files' tensors at load (e.g. {converted[:3]}: "
                   f"merged or split by the conversion mapping of {type(reference).__name__}), which "
                   "hf.load_pretrained does not do beyond stacking experts (Note [experts stacked at load]): build "
                   "the model with from_pretrained on every rank, then parallelize it")
        raise KeyError(f"hf.load_pretrained: the files hold no tensor for {missing[:10]}"
                       f"{' ...' if len(missing) > 10 else ''} ({len(missing)} missing); they hold {len(shapes)} "
                       f"tensors, e.g. {sorted(shapes)[:5]}{why}")
    if wrong:
        raise ValueError("hf.load_pretrained: shape mismatch between the files and the model: " + "; ".join(wrong[:10]))
    return sources


# Note [checkpoint key renamings]: transformers 5 reads some families' files under other names
# than its modules' (its conversion mapping, applied in from_pretrained and reversed in
# save_pretrained): GPT-NeoX's head is `embed_out` in the files and `lm_head` in the model; the
# "legacy" renamings apply to every model. A key that a renaming maps to a model name is read
# under its file name, so such directories load as transformers loads them.
#
# Note [experts stacked at load]: mixtures of experts are stored one tensor per expert
# (Mixtral's `block_sparse_moe.experts.3.w1.weight`, Qwen3-MoE's `mlp.experts.3.gate_proj.weight`)
# and held stacked (`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden]): the mapping's
# WeightConverter stacks each source pattern's tensors over the expert index (MergeModulelist,
# dim 0) and, with several patterns, concatenates the stacks (Concatenate: w1 then w3, gate then
# up, along dim 1). Those two are read as what they are, a piecewise layout: a box of the model's
# tensor - a tensor-parallel shard of each packed block, a ZeRO flat piece - is, for each expert
# in it and each pattern it overlaps, a box of one per-expert tensor in the files, and only those
# boxes are read. Other conversions (splits, permutations, quantized formats) are not done: the
# missing-tensor error names them.
def _checkpoint_renamings(reference: nn.Module, shapes: dict
                          ) -> tuple[dict[str, str], dict[str, _Stacked], list[str], dict[str, str]]:
    """(model name -> file key) for the files' keys that transformers renames at load, (model
    name -> _Stacked) for the experts it stacks, the file keys it would convert otherwise, and
    (model name -> why) for experts that do not stack."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers before 5: files and modules share names
        return {}, {}, [], {}
    transforms = get_model_conversion_mapping(reference)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed, converted = {}, []
    experts: dict[str, dict[str, dict[int, str]]] = {}  # model name -> source pattern -> expert -> file key
    how: dict[str, tuple] = {}  # model name -> (the converter's source patterns, its concatenation dim)
    for key in shapes:
        new, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if new != key:
                renamed[new] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        dim = _stacking_dim(converter)
        index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), rename_source_key(key, renamings, [])[0])
        if dim is False or index is None or not index.groups():
            converted.append(key)
            continue
        experts.setdefault(new, {}).setdefault(pattern, {})[int(index.group(index.lastindex))] = key
        how[new] = (tuple(converter.source_patterns), dim)
    stacked, unstacked = {}, {}
    for name, by_pattern in experts.items():
        patterns, dim = how[name]
        found = _stack([by_pattern.get(p, {}) for p in patterns], patterns, dim, shapes)
        if isinstance(found, _Stacked):
            stacked[name] = found
        else:
            unstacked[name] = found
    return renamed, stacked, converted, unstacked


def _stacking_dim(converter) -> int | None | bool:
    """The concatenation dim of a converter that stacks experts (MergeModulelist(dim=0), then
    Concatenate(dim >= 1) with several patterns): None with one pattern, False if it does more."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops == [("MergeModulelist", 0)] and len(converter.source_patterns) == 1:
        return None
    if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" and ops[1][1] >= 1 \
            and len(converter.source_patterns) > 1:
        return ops[1][1]
    return False


def _stack(by_pattern: list[dict[int, str]], patterns: tuple[str, ...], dim: int | None,
           shapes: dict) -> _Stacked | str:
    """The _Stacked from each pattern's expert -> file key; why not, if they do not stack (an
    expert missing, shapes that differ)."""
    count = max(len(experts) for experts in by_pattern)
    for pattern, experts in zip(patterns, by_pattern):
        if sorted(experts) != list(range(count)):
            absent = sorted(set(range(count)) - set(experts))
            return f"the files hold {pattern!r} for experts {sorted(experts)}, not for {absent}"
    per_expert = [{shapes[k] for k in experts.values()} for experts in by_pattern]
    for pattern, found in zip(patterns, per_expert):
        if len(found) != 1:
            return f"the experts' {pattern!r} tensors differ in shape: {sorted(found)}"
    parts = [next(iter(s)) for s in per_expert]
    if dim is None:
        sizes, shape = (), (count, *parts[0])
    else:
        rest = {p[:dim - 1] + p[dim:] for p in parts}
        if len(rest) != 1 or len(parts[0]) < dim:
            return f"{dict(zip(patterns, parts))} do not concatenate along dim {dim - 1}"
        sizes = tuple(p[dim - 1] for p in parts)
        shape = (count, *parts[0][:dim - 1], sum(sizes), *parts[0][dim:])
    return _Stacked(tuple(tuple(experts[e] for e in range(count)) for experts in by_pattern), dim, sizes, shape)


def _box(offsets, sizes) -> tuple:
    """The index of a piece's box in the file's tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def _read_stacked(tp, stacked: _Stacked, files: dict[str, str]) -> None:
    """Copy the pieces of a tensor stacked from per-expert ones (Note [experts stacked at
    load]): for each expert in a piece and each source pattern it overlaps, one box of one file
    tensor."""
    from safetensors import safe_open
    d = stacked.dim
    with contextlib.ExitStack() as opened, torch.no_grad():
        handles = {}
        for piece in tp.pieces:
            dest, o, n = piece.view(tp.local), piece.global_offsets, piece.sizes
            starts = [sum(stacked.sizes[:j]) for j in range(len(stacked.sizes))] if d is not None else [0]
            for e in range(o[0], o[0] + n[0]):
                for keys, start, size in zip(stacked.keys, starts, stacked.sizes or (None,)):
                    box = [slice(a, a + b) for a, b in zip(o[1:], n[1:])]
                    out = dest[e - o[0]]
                    if d is not None:  # this pattern's part of the piece along the concatenation dim
                        lo, hi = max(o[d], start), min(o[d] + n[d], start + size)
                        if lo >= hi:
                            continue
                        box[d - 1] = slice(lo - start, hi - start)
                        out = out.narrow(d - 1, lo - o[d], hi - lo)
                    key = keys[e]
                    if files[key] not in handles:
                        handles[files[key]] = opened.enter_context(safe_open(files[key], framework="pt"))
                    out.copy_(handles[files[key]].get_slice(key)[tuple(box)])


# Note [both copies of a tie in the files]: a model that ties its head to its embedding
# (config.tie_word_embeddings) holds one tensor under two names; transformers' save_pretrained
# writes it once. Files that hold both names - an untied model's checkpoint under a config that
# ties, or a tied model saved by a tool that writes every name - are read by transformers'
# from_pretrained as what they are: equal copies are tied, different ones untie the model
# (each name gets its own values, with a warning). hf.load_pretrained fills a model whose ties
# were fixed before it was parallelized, so it compares the copies (each rank a slice of rows,
# RAM bounded by _COMPARE_ROWS rows): equal ones load as one tensor, different ones are refused
# on every rank, naming how to build the model untied. Loading one of them silently would
# train a different model than from_pretrained's.
_COMPARE_ROWS = 4096


def _tied_copies(reference: nn.Module, hf_model: nn.Module, shapes: dict[str, tuple[int, ...]]
                 ) -> list[tuple[str, str]]:
    """(the key read, another key of the same tied tensor) for every tie the files hold twice."""
    base = getattr(hf_model, "base_model_prefix", "")
    pairs = []
    for names in _names_by_tensor(reference):
        keys = []
        for name in names:
            key = next((c for c in _candidates(name, base) if c in shapes), None)
            if key is not None and key not in keys:
                keys.append(key)
        pairs.extend((keys[0], other) for other in keys[1:])
    return pairs


def _differing_copies(pairs: list[tuple[str, str]], files: dict[str, str], shapes: dict[str, tuple[int, ...]],
                      group) -> list[tuple[str, str]]:
    """The pairs whose tensors differ in the rows this rank compares (a 1/world share of each)."""
    from safetensors import safe_open
    rank, world = rank_world(group)
    differ = []
    for first, other in pairs:
        if shapes[first] != shapes[other]:
            differ.append((first, other))
            continue
        rows = shapes[first][0] if shapes[first] else 1
        share = -(-rows // world)
        lo, hi = min(rank * share, rows), min((rank + 1) * share, rows)
        with safe_open(files[first], framework="pt") as a, safe_open(files[other], framework="pt") as b:
            x, y = a.get_slice(first), b.get_slice(other)
            if not shapes[first]:
                same = torch.equal(x[:], y[:])
            else:
                same = all(torch.equal(x[i:min(i + _COMPARE_ROWS, hi)], y[i:min(i + _COMPARE_ROWS, hi)])
                           for i in range(lo, hi, _COMPARE_ROWS))
        if not same:
            differ.append((first, other))
    return differ


def _refuse_differing_copies(differ: list[tuple[str, str]], shapes: dict[str, tuple[int, ...]], hf_model: nn.Module,
                             directory: str) -> None:
    if not differ:
        return
    first, other = differ[0]
    how = ("a different shape" if shapes[first] != shapes[other] else "different values")
    flag = ("config.tie_word_embeddings = False" if getattr(hf_model.config, "tie_word_embeddings", False)
            else "the model's config untied")
    raise ValueError(
        f"hf.load_pretrained: the model ties {other} to {first} (one tensor), but {directory} holds both, with {how} "
        f"(a checkpoint of an untied model); transformers' from_pretrained unties such a model and loads each. Build "
        f"the model with {flag} (set on the config before constructing it), then parallelize and load it; or, to "
        f"keep the tie, remove {other!r} from the files")


def _read_pieces(described: placement.ModelPlacement, sources: dict[str, _Source], files: dict[str, str]) -> None:
    """Copy every piece this rank holds from the files into its local tensor."""
    from safetensors import safe_open
    for name, tp in described.tensors.items():
        source = sources[name]
        if source.stacked is not None and tp.pieces:
            _read_stacked(tp, source.stacked, files)
            continue
        if source.key is None or not tp.pieces:
            continue
        # One open file per tensor: the pages of the memory-mapped file a rank reads stay
        # resident (and counted in its RSS) until the file is closed, so closing after each
        # tensor keeps them to one tensor's share rather than the file's.
        with safe_open(files[source.key], framework="pt") as f, torch.no_grad():
            tensor = f.get_slice(source.key)
            for piece in tp.pieces:
                data = tensor[_box(piece.global_offsets, piece.sizes)]
                piece.view(tp.local).copy_(data)
        del f, tensor, data  # the mapping goes with the last reference


def _buffers_from_reference(hf_model: nn.Module, held: nn.Module, reference: nn.Module, loaded: set[str],
                            adapted: _peft.Adapted | None = None) -> None:
    """Every buffer this rank holds (in `held`: a pipeline rank holds its stages' only) and
    did not read from the files (`loaded`) gets the value the constructor computes (Note
    [buffers not in the files]); names through peft's layers as in _plan_sources."""
    ref_buffers = dict(reference.named_buffers())
    mine = {id(b) for b in held.buffers()}
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name in loaded or id(buf) not in mine:
                continue
            plain = adapted.file_name(name) if adapted is not None else name
            if plain not in ref_buffers:
                raise KeyError(f"hf.load_pretrained: buffer {name} is neither in the files nor built by "
                               f"{type(reference).__name__}'s constructor")
            buf.copy_(ref_buffers[plain])


def load_pretrained(directory: str, model, *, device: torch.device | str | None = None, group=None,
                    adapter_seed: int | None = None):
    """Fill `model` - this rank's part of a transformers model at any layout (tensor parallel,
    ZeRO 1-3, DataParallel, or the `Parallelized` of `parallelize`, pipelined by
    `pipeline_layers="auto"` or not), possibly built on the meta
    device - from the safetensors in `directory` (`model.safetensors`, or the files of
    `model.safetensors.index.json`), each rank reading only the boxes it holds; a collective
    over `group` (default: every rank). Returns `model`.

    Tensors on the meta device first get storage on `device` (default: the `Parallelized`'s
    device, else cuda:LOCAL_RANK with GPUs, else the CPU; parallel_layers/meta.py). Values are
    cast to the dtype the model holds (ZeRO: its float32 masters; a frozen parameter's own
    dtype). Buffers the files lack (rotary `inv_freq`) are computed by the model's constructor
    (Note [buffers not in the files]). A missing tensor, a shape mismatch or a directory without safetensors raises on
    every rank, naming them; tensors the files hold and the model does not are warned about.

    A model adapted by peft (the PeftModel, or its base model with LoRA layers inside) gets its
    base layers from the files; its adapters keep their values, or, where they are on the meta
    device, get peft's initialization for their config, drawn from `adapter_seed` (default: rank
    0's torch.initial_seed()) and each layer's name, the same at every layout (Note [adapters
    built on the meta device] in _peft.py).
    """
    from parallel_layers.parallel_dims import default_device

    if adapter_seed is not None and (isinstance(adapter_seed, bool) or not isinstance(adapter_seed, int)):
        raise TypeError(f"hf.load_pretrained: adapter_seed must be an int (the seed every rank draws peft's "
                        f"initial adapters from) or None (rank 0's torch.initial_seed()); got {adapter_seed!r}")
    module, ctx_device = _unwrap(model)
    hf_model = _hf_model(module, "hf.load_pretrained")
    adapted = _peft.adapted(hf_model)  # Note [adapters built on the meta device] in _peft.py
    rank, _ = rank_world(group)
    mine = described = sources = files = reference = None
    used: set[str] = set()
    differ: list[tuple[str, str]] = []
    adapters: list[str] = []  # the adapter tensors on the meta device: peft's initialization
    try:
        files = _weight_files(os.fspath(directory))
        shapes = _file_shapes(files)
        reference = _reference(adapted.model)
        described = placement.describe(module)
        described.check_storage()
        sources = _plan_sources(described, adapted, reference, shapes, files)
        adapters = [n for n, s in sources.items() if s.adapter and described.tensors[n].local.is_meta]
        adapted.check_initializable(adapters, "hf.load_pretrained")
        copies = _tied_copies(reference, adapted.model, shapes)  # Note [both copies of a tie in the files]
        differ = _differing_copies(copies, files, shapes, group)
        used = set().union(*(s.file_keys() for s in sources.values()), (other for _, other in copies))
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = e
    reports = all_gather((describe_error(mine) if mine else None, used, differ, torch.initial_seed()), group)
    raise_if_any([report[0] for report in reports], mine, "hf.load_pretrained")
    # each rank compared a share of the rows: every rank refuses what any rank found
    _refuse_differing_copies(sorted(set().union(*(report[2] for report in reports))), shapes, adapted.model,
                             os.fspath(directory))
    seed = reports[0][3] if adapter_seed is None else adapter_seed  # one seed: every rank draws the same adapters

    used = set().union(*(report[1] for report in reports))  # pipeline ranks read different tensors
    unexpected = [k for k in files if k not in used]
    if unexpected and rank == 0:
        warnings.warn(f"hf.load_pretrained: {directory} holds {len(unexpected)} tensor(s) the model does not have, "
                      f"not loaded: {unexpected[:10]}", RuntimeWarning, stacklevel=2)

    mine = None
    try:
        if meta.has_meta(module):
            meta.materialize(module, device if device is not None else ctx_device or default_device(),
                             warn_unfilled_buffers=False)  # _buffers_from_reference fills them below
            described = placement.describe(module)  # the same tensors, now with storage
        _read_pieces(described, sources, files)
        _initialize_adapters(described, adapted, adapters, seed)
        _buffers_from_reference(hf_model, module, reference, {n for n, s in sources.items() if not s.from_reference},
                                adapted)
    except Exception as e:  # noqa: BLE001
        mine = e
    raise_if_any(all_gather(describe_error(mine) if mine else None, group), mine, "hf.load_pretrained")
    for hook in described.after_load:  # the wrappers' collectives (ZeRO's all-gathers): every rank
        hook()
    return model


def _initialize_adapters(described: placement.ModelPlacement, adapted: _peft.Adapted, names: list[str],
                         seed: int) -> None:
    """Write peft's initial values of the adapter tensors `names` into the pieces this rank
    holds (Note [adapters built on the meta device] in _peft.py)."""
    if not names:
        return
    values = adapted.initial_values({n: tuple(described.tensors[n].shape) for n in names}, seed)
    with torch.no_grad():
        for name in names:
            tp = described.tensors[name]
            for piece in tp.pieces:
                piece.view(tp.local).copy_(values[name][_box(piece.global_offsets, piece.sizes)])


def materialize(model, *, device: torch.device | str | None = None):
    """Give a transformers model built on the meta device (at any layout, or the `Parallelized`
    of `parallelize`) storage, without pretrained weights: to resume from a checkpoint
    (`checkpoint.load` next) or to initialise yourself. Parameters and persistent buffers are
    zeros; the non-persistent buffers no checkpoint holds (rotary inv_freq, Gemma's
    embed_scale) get the values the model's constructor computes (Note [buffers not in the
    files]). `device` as for load_pretrained. Not a collective. Returns `model`."""
    from parallel_layers.parallel_dims import default_device

    module, ctx_device = _unwrap(model)
    hf_model = _hf_model(module, "hf.materialize")
    adapted = _peft.adapted(hf_model)
    meta.materialize(module, device if device is not None else ctx_device or default_device(),
                     warn_unfilled_buffers=False)
    _buffers_from_reference(hf_model, module, _reference(adapted.model), set(), adapted)
    return model


__all__ = ["load_pretrained", "materialize", "save_pretrained"]
