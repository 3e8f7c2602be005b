"""An asynchronous device-side assert whose message always fits.

Note [a device assert's message]: `torch._assert_async(condition, message)` is how the library
checks a batch on a GPU without a host sync (Note [range checks on a device] in
tensor_parallel/vocab.py). On CUDA it copies the message into a fixed kernel argument and
refuses, on the host and whether the condition holds or not, a message of 255 characters or
more ("Message length must be smaller than 255"; MPS: 250); the CPU's has no limit, so no CPU
test saw it. A message naming a group's ranks grows with them: the same-batch check of the
tensor-parallel ranks 8-15 of a two-node tp=8 job wrote 255 characters and raised on those ranks
alone, before the data-parallel all-reduce that the others then waited in (review finding,
helper-83). Every device assert goes through `assert_async`, which keeps a message to
`MAX_MESSAGE` characters, its head kept and the cut marked.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_MESSAGE = 249  # under both torch's bounds: CUDA's 255 and MPS's 250 characters


def fitted(message: str) -> str:
    """`message`, cut to MAX_MESSAGE characters (the cut marked by '...')."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."


def assert_async(condition: Tensor, message: str) -> None:
    """torch._assert_async with a message that every device's assert takes."""
    torch._assert_async(condition, fitted(message))
