"""load() at the current layout, whatever wrote the checkpoint; export_state_dict() for one device.

Resharding is DCP's: each rank presents the pieces it holds now (parallel_layers.placement,
checkpoint/_present.py) and DCP reads, from every saved chunk that overlaps one of them,
exactly the overlapping bytes. So a rank reads only what it needs, and the writer may be any
of our layouts, a plain `dcp.save` of the unparallelized model, or FSDP2 + DTensor TP.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from parallel_layers.checkpoint import _io
from parallel_layers.checkpoint._dist import all_gather, describe_error, quiet, raise_if_any, rank_world
from parallel_layers.checkpoint._safe import SafeLoadPlanner, SafeReader
from parallel_layers.checkpoint._save import _wait_in_flight, layout_signature, unwrap
from parallel_layers.checkpoint._state import (MODEL, OPTIMIZER, RNG, OptimizerLoad, has_optimizer, model_state,
                                               rng_template, set_rng)
from parallel_layers.placement import ModelPlacement, describe


def _model_keys(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    head = f"{MODEL}."
    return {k[len(head):]: md for k, md in metadata.state_dict_metadata.items()
            if k.startswith(head) and isinstance(md, TensorStorageMetadata)}


def _check(path: str, saved: dict[str, TensorStorageMetadata], described: ModelPlacement, optimizer,
           metadata: Metadata) -> None:
    """This rank's tensors exist in the checkpoint with the same logical shapes."""
    held = [n for n, tp in described.tensors.items() if tp.pieces]
    missing = [n for n in held if n not in saved]
    if missing:
        raise KeyError(f"the checkpoint {path} has no tensor for {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
                       f"it holds {len(saved)} model keys, e.g. {list(saved)[:5]}")
    wrong = [f"{n}: checkpoint {tuple(saved[n].size)} vs model {described.tensors[n].shape}"
             + (" (its transpose: parallel_layers before 2026-11-27 saved a GPT-2 Conv1D weight [out, in] at tp > 1, "
                "it now holds [in, out] at every layout, as the plain model does: Note [transposed weights])"
                if len(saved[n].size) == 2 and tuple(saved[n].size) == tuple(described.tensors[n].shape)[::-1] else "")
             for n in held if tuple(saved[n].size) != tuple(described.tensors[n].shape)]
    if wrong:
        raise ValueError("shape mismatch between checkpoint and model (logical, unparallelized shapes): "
                         + "; ".join(wrong))
    if optimizer is not None and not has_optimizer(metadata):
        raise ValueError("the checkpoint was saved without optimizer state; pass optimizer=None to load the model only")


# Note [ties in a checkpoint]: a model that ties two keys (an embedding read by the head) holds
# one tensor under both; loading a checkpoint that holds them as two tensors - saved by the
# untied model - writes both into that one tensor, and the last one written wins: training went
# on from a head that was neither of the saved ones, with no error (review finding: a loss of
# 5.54 where the saved model gave 5.28). Our checkpoints record which keys were one tensor at
# save ("tied" in parallel_layers.json); a load into a model that ties keys held apart there is
# refused. (A tied checkpoint into an untied model gives both keys the one value, as
# from_pretrained does when it unties; plain DCP checkpoints record no ties.)
def _check_ties(path: str, saved: dict, described: ModelPlacement, tied: list[list[str]]) -> None:
    together = {name: set(group) for group in tied for name in group}
    for tp in described.tensors.values():
        apart = [a for a in tp.aliases if tp.name in saved and a in saved and a not in together.get(tp.name, ())]
        if apart:
            raise ValueError(f"checkpoint {path} holds {tp.name} and {apart} as separate tensors (the model that saved "
                             f"it did not tie them), but this model ties them: loading would keep one of them for "
                             "both. Build the model untied (e.g. tie_word_embeddings=False in its config), or save "
                             "from a model that ties them")


# Note [one checkpoint on every rank]: each rank passes its own `path`, and a rank that picks it
# differently - latest_checkpoint(root) called while an async_save was still committing (rank 0
# waited for the handle, rank 1 did not), a path built from a rank-local step - read another
# step's files. With the same layout the load went through on every rank: tensor-parallel shards
# from two different steps trained on, with no error (review finding). Every rank now names the
# checkpoint it opened (its step and a digest of the sizes and CRC-32s its files were written
# with, or for another program's checkpoint the size and CRC-32 of DCP's .metadata) and all
# raise if they differ. Checkpoints copied to a node-local path still agree: the digest is of
# the contents, not of the path.
def _check_same_checkpoint(identities: list) -> None:
    if len({(i["what"], i["digest"]) for i in identities}) > 1:
        per_rank = "; ".join(f"rank {r}: {i['path']} ({i['what']})" for r, i in enumerate(identities))
        raise ValueError(f"checkpoint load: the ranks opened different checkpoints ({per_rank}); every rank must load "
                         "the same one. Pick the path once - e.g. checkpoint.latest_checkpoint(root) on every rank "
                         "after the last save has finished (it waits for this process's async_save), or on rank 0 "
                         "and broadcast it")


def load(path: str, model, optimizer=None, *, group=None, strict: bool = True, restore_rng: bool = True,
         prefix: str = "") -> dict:
    """Load the checkpoint at `path` (a step_<N> directory, or any DCP checkpoint whose model
    is under "model") into `model` and `optimizer` at the current layout; a collective.
    Returns the `extra` dict given to save ({} for a checkpoint not written by us).

    strict: every model key of the checkpoint must be held by some rank. prefix: as for
    save. The RNG state is restored only at the layout it was saved at. On an error every
    rank raises; the model may then be partly loaded.
    """
    own_optimizer = optimizer is None and getattr(type(model), "checkpoint_parts", None) is not None
    model, optimizer, prefix = unwrap(model, optimizer, prefix)
    _wait_in_flight()
    rank, world = rank_world(group)
    mine = described = metadata = ours = signature = saved = identity = None
    try:
        path = _io.check_path(path)
        identity = _io.identity(path)
        metadata = SafeReader(path).read_metadata()
        if os.path.isfile(os.path.join(path, _io.OURS)):
            ours = _io.read_ours(path)
            found = _io.problems(path, crc=False)
            if found:
                raise ValueError(f"checkpoint {path} is corrupt: {'; '.join(found)}")
        saved = _model_keys(metadata)
        described = describe(model, prefix)
        described.check_storage()
        on_meta = [name for name, tp in described.tensors.items() if tp.local.is_meta]
        if on_meta:
            raise ValueError(
                f"checkpoint load: the model still has tensors on the meta device ({len(on_meta)}, e.g. "
                f"{on_meta[:3]}): it was built under torch.device('meta') and has no storage to load into. Give it "
                "storage first: hf.materialize(model) for a Hugging Face model (it also computes the buffers no "
                "checkpoint holds, such as the rotary inv_freq), else parallel_layers.meta.materialize(model, device) "
                "and compute such buffers yourself")
        if own_optimizer and optimizer is not None and not has_optimizer(metadata):
            # a Parallelized brings its optimizer, which the caller did not name: a model-only
            # checkpoint (plain DCP, FSDP2's model state, a fine-tune's start) loads the model and
            # leaves the optimizer as it is, where "pass optimizer=None" could not be followed
            # (review finding, helper-75); the same on every rank (one checkpoint, one kind of model)
            if rank == 0:
                warnings.warn(f"checkpoint load: {path} holds no optimizer state; the model is loaded and the "
                              "optimizer keeps its own state", stacklevel=2)
            optimizer = None
        _check(path, saved, described, optimizer, metadata)
        if ours is not None and "tied" in ours:
            _check_ties(path, saved, described, ours["tied"])
        signature = layout_signature(described, world)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = e
    gathered = all_gather((describe_error(mine) if mine else None,
                           list(described.tensors) if described else [], signature, identity,
                           optimizer is not None), group)
    raise_if_any([g[0] for g in gathered], mine, "checkpoint load")
    _check_same_checkpoint([g[3] for g in gathered])
    with_opt = [g[4] for g in gathered]
    if any(with_opt) and not all(with_opt):  # as save refuses it (the others' shards would keep no state)
        raise ValueError(f"checkpoint load: an optimizer was passed on ranks {[r for r, o in enumerate(with_opt) if o]} "
                         "only; pass this rank's optimizer on every rank, or none")
    if strict:
        held = {k for g in gathered for k in g[1]}
        unexpected = [k for k in saved if k not in held]
        if unexpected:
            raise KeyError(f"the checkpoint holds {unexpected[:10]}, which no rank's model has; pass strict=False to "
                           "ignore them")
    same_layout = ours is not None and ours["world_size"] == world and [g[2] for g in gathered] == ours["signatures"]

    mine = state = optimizer_load = None
    try:
        state = {MODEL: model_state(described)}
        if optimizer is not None:
            optimizer_load = OptimizerLoad(optimizer, described, metadata)
            state[OPTIMIZER] = optimizer_load.template
        if restore_rng and same_layout:
            state[RNG] = rng_template(rank, metadata)
    except Exception as e:  # noqa: BLE001
        mine = e
    raise_if_any(all_gather(describe_error(mine) if mine else None, group), mine, "checkpoint load")
    quiet(dcp.load)(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), process_group=group,
             no_dist=not dist.is_initialized())

    mine = None
    try:
        if optimizer_load is not None:
            optimizer_load.apply(state[OPTIMIZER])
        if RNG in state:
            set_rng(state[RNG])
    except Exception as e:  # noqa: BLE001
        mine = e
    raise_if_any(all_gather(describe_error(mine) if mine else None, group), mine, "checkpoint load")
    for hook in described.after_load:  # collectives of the wrappers (ZeRO's all-gathers): every rank, or none
        hook()
    if restore_rng and not same_layout and rank == 0:
        why = ("it was written by another program" if ours is None else
               f"it was saved by {ours['world_size']} rank(s) in another layout than these {world} rank(s) have now")
        warnings.warn(f"checkpoint load: RNG state not restored: {why}; random streams (dropout, data shuffling "
                      "seeded from them) continue from their current state", RuntimeWarning, stacklevel=2)
    return ours["extra"] if ours is not None else {}


def export_state_dict(path: str) -> dict[str, Tensor]:
    """The plain, full state dict of the model saved at `path`, for the unparallelized model's
    `load_state_dict(strict=True)`; one process, no torch.distributed needed. ZeRO-trained
    parameters come back as their float32 masters (frozen ones in their own dtype)."""
    path = _io.check_path(path)
    metadata = SafeReader(path).read_metadata()
    out = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in _model_keys(metadata).items()}
    quiet(dcp.load)({MODEL: out}, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                    no_dist=True)
    return out
