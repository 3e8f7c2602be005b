"""Checkpoints of model, optimizer, RNG and data position: torch.distributed.checkpoint (DCP)
directories, written from any layout and loadable at any other.

    path = checkpoint.save("ckpt", step, zero, zero.optimizer, extra={"samples_seen": n})
    handle = checkpoint.async_save("ckpt", step, zero, zero.optimizer)   # training goes on
    ...                                                   # later, at any layout
    extra = checkpoint.load(checkpoint.latest_checkpoint("ckpt"), model, optimizer)
    model_1gpu.load_state_dict(checkpoint.export_state_dict(path))   # strict, no dist

What is stored (_state.py): the unparallelized model's state_dict under "model", the
optimizer's state and settings by parameter name under "optimizer" (torchtitan's flattened
form), each rank's RNG state under "rng"; `extra` and the integrity records in
parallel_layers.json beside DCP's files (_io.py). Each rank contributes the pieces its
placement describes (parallel_layers.placement, _present.py): no padding, replicas written
once, so DCP's own readers - `dcp.load` of a plain model, FSDP2 + DTensor TP - read the
directory, and we read theirs.

Guarantees: atomic commit with `latest` (Note [atomic save] in _io.py); `latest_checkpoint`
returns only a checkpoint whose files match their recorded sizes and CRC-32s (Note
[integrity]); bitwise resume at the same layout (RNG restored only then); errors raised on
every rank together (Note [errors on every rank] in _dist.py). The first format (rank<r>.pt
+ metadata.json) converts with `python -m parallel_layers.checkpoint.convert`.
"""

from parallel_layers.checkpoint._io import verify
from parallel_layers.checkpoint._load import export_state_dict, load
from parallel_layers.checkpoint._save import AsyncSave, async_save, latest_checkpoint, save, wait

__all__ = ["AsyncSave", "async_save", "export_state_dict", "latest_checkpoint", "load", "save", "verify", "wait"]
