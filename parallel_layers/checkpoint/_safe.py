"""Reading DCP checkpoints without running pickled code.

DCP stores its `.metadata` with `pickle` and non-tensor values (optimizer settings such as
`lr` and `betas`) as `torch.save` blobs, and its own reader unpickles both with no
restriction: a crafted checkpoint runs code on load. Our reader keeps DCP's format and
unpickles `.metadata` with an allowlist (DCP's metadata dataclasses and enums, torch.Size,
dtypes, layouts, memory formats, plain containers), and values with
`torch.load(weights_only=True)` (numbers, strings, tuples, lists, dicts, tensors). Anything
else is refused with pickle.UnpicklingError. Tensors are read by DCP itself, already with
weights_only=True.
"""

from __future__ import annotations

import enum
import io
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_TORCH_TYPES = (torch.Size, torch.dtype, torch.layout, torch.memory_format)
_BUILTINS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
             ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("builtins", "slice"),
             ("torch.serialization", "_get_layout")}  # how torch.layout pickles: a name -> layout lookup


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _BUILTINS:
            return super().find_class(module, name)
        if module.startswith(_DCP_MODULES):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)):
                return obj
        if module == "torch" or module.startswith("torch."):
            obj = getattr(torch, name, None) if module == "torch" else None
            if obj is torch.Size or isinstance(obj, _TORCH_TYPES):
                return obj
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from a checkpoint's .metadata: only DCP's "
                                     "metadata types are loaded, never arbitrary pickle")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read through the allowlist above."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner with values unpickled as weights_only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"refusing to load {read_item.dest_index.fqn!r} from a checkpoint: it is not "
                                         f"a plain value and values are read with weights_only=True ({e})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

