"""Random streams of the library's own that a checkpoint saves beside the default generators'.

A module that keeps such a stream (tensor_parallel/region_random.py: each rank's stream for the
draws inside tensor-parallel regions) registers a getter and a setter under a name; the
checkpoint (parallel_layers/checkpoint/_state.py) saves what the getters return in the rank's
RNG state and hands a loaded state's entries back to the setter of their name. A registry, so
that the checkpoint needs no import of the modules that keep the streams (tests/test_structure.py:
it reads the placement description and nothing else of the library).
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import Tensor

Getter = Callable[[], dict[str, Tensor]]  # entry name -> state; every name starts with "<name>_"
Setter = Callable[[dict[str, Tensor]], None]

_streams: dict[str, tuple[Getter, Setter]] = {}


def register(name: str, get: Getter, put: Setter) -> None:
    _streams[name] = (get, put)


def state_dict() -> dict[str, Tensor]:
    """Every registered stream's entries."""
    out: dict[str, Tensor] = {}
    for get, _ in _streams.values():
        out.update(get())
    return out


def load_state_dict(states: dict[str, Tensor]) -> None:
    """Hand each registered stream the entries of its name, none when the checkpoint holds none
    (the stream then knows this restore brought nothing of its own)."""
    for name, (_, put) in _streams.items():
        put({k: v for k, v in states.items() if k.startswith(f"{name}_")})


def get_state(device: torch.device) -> Tensor:
    """The default generator's state of `device` (the CPU's, or a CUDA device's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def device_key(device: torch.device) -> torch.device:
    """One key per generator: the CPU, or the CUDA device with its index (the current one for
    a bare "cuda")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device if device.type == "cuda" else torch.device("cpu")


def fresh_state(device: torch.device, seed: int) -> Tensor:
    """A generator state of `device`'s kind seeded with `seed`, leaving the default generator alone."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g.get_state()


def digest_seed(*states: Tensor) -> int:
    """A seed derived from generator states (the same states give the same seed): for a stream
    of the library's own, seeded from the default ones without drawing from them."""
    return int.from_bytes(hashlib.sha256(b"".join(s.numpy().tobytes() for s in states)).digest()[:7], "little")


def to_entries(name: str, states: dict[torch.device, Tensor], cuda: torch.device | None = None) -> dict[str, Tensor]:
    """A stream's per-device states as checkpoint entries "<name>_cpu" / "<name>_cuda": the CPU's
    and `cuda`'s (the current CUDA device's when None)."""
    return {f"{name}_{d.type}": s.clone() for d, s in states.items()
            if d.type == "cpu" or d == (cuda or device_key(torch.device("cuda")))}


def from_entries(name: str, entries: dict[str, Tensor], cuda: torch.device | None = None) -> dict[torch.device, Tensor]:
    """`to_entries`' inverse: the CUDA entry goes to `cuda` (the current CUDA device when None),
    and is dropped where there is no CUDA."""
    out = {}
    for key, s in entries.items():
        kind = key.removeprefix(f"{name}_")
        if kind == "cpu":
            out[torch.device("cpu")] = s.clone()
        elif kind == "cuda" and torch.cuda.is_available():
            out[cuda or device_key(torch.device("cuda"))] = s.clone()
    return out
