"""Checkpoints of model, optimizer, RNG and data position, for every layout, reshardable.

    path = checkpoint.save("ckpt", step, zero, zero.optimizer, extra={"samples_seen": n})
    ...                                                   # later, at any layout
    extra = checkpoint.load(checkpoint.latest_checkpoint("ckpt"), model, optimizer)
    model_1gpu.load_state_dict(checkpoint.export_state_dict(path))   # strict, no dist

Layout-free contents. Tensors are stored under logical names - the unparallelized model's
state_dict keys ("model/<key>") and one per optimizer state ("optim/<key>/exp_avg") - as
pieces: the box of the full tensor a rank holds (tensor parallelism, fused QKV blocks
included), narrowed to an element range under ZeRO (Note [checkpoint pieces] in _layout.py).
Loading assembles each logical tensor and cuts the pieces of the current layout, so a
checkpoint saved at tp=2 x dp=2 with ZeRO-1 loads at tp=1 x dp=4 with ZeRO-3, with
DataParallel, or in one process. Pipeline stages simply contribute disjoint names (each
stage keeps the unparallelized model's names for its layers).

Files. Each rank writes the pieces it owns to rank<r>.pt (torch.save of str -> Tensor);
replicated pieces are written once, by the lowest rank (Note [replicated pieces] in
_save.py). Everything else is JSON (metadata.json): the piece table with a CRC-32 per
piece, optimizer scalars (Adam's step) and hyperparameters, `extra`. Loading reads JSON
and torch.load(weights_only=True) files only, so a checkpoint never runs pickled code.
Saves are atomic (Note [atomic save] in _io.py): a crash mid-save leaves the previous
checkpoint intact and the unfinished one ignored.

RNG. Every rank's torch (and CUDA) generator state is saved and restored only when loading
at the same world size with every rank holding the same pieces as at save; at another
layout the per-rank streams have no counterpart, so they are left as they are (a warning).

Errors are raised on every rank together (Note [errors on every rank] in _dist.py).
"""

from parallel_layers.checkpoint._io import latest_checkpoint
from parallel_layers.checkpoint._load import export_state_dict, load
from parallel_layers.checkpoint._save import save

__all__ = ["export_state_dict", "latest_checkpoint", "load", "save"]
