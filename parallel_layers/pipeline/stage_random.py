"""A random stream of each pipeline rank's own for what its stages draw.

Note [a random stream per pipeline stage]: every rank builds the same model from the same seed
(the usual `torch.manual_seed(0)` on every rank), so every pipeline rank's default generator
starts at the same state, and stage 1's first block drew exactly the dropout masks stage 0's
first block drew: layers L and L + n / p dropped the same positions at every step, which no
single-device model does. Megatron seeds its pipeline ranks apart (its seed + 100 x the rank).
Reseeding the default generator would do the same and break something else: the user's own
draws after `parallelize` - a batch of `torch.randint`, a DataLoader's shuffle, which seeds its
sampler from the default generator - would then differ between the pipeline ranks, which must
all see the same batch (stage 0 reads its inputs, the last stage its targets): inputs of one
batch trained against targets of another, silently.

So the stages draw from a stream of their own, swapped in around each stage's forward
(`active`) and out again after it, as the TP region streams are (tensor_parallel/region_random.py):

  * `seed(pp_rank, device)` (PipelineParallel at p > 1) seeds it with a digest of the default
    generators' states (the CPU's, and the CUDA device's) plus 100 x the pipeline rank. The ranks
    of one stage's TP group share those states (Note [one random stream per tensor-parallel
    group]) and so one stage stream; data-parallel replicas seeded apart stay apart. The TP
    region streams are seeded again from it, so that they too differ between stages.
  * Tensor parallelism applied after the pipeline is built (the other way round from
    `parallelize`'s order) seeds the stage stream again once the TP group shares its stream:
    seeded before, from each rank's own state, it could differ between the ranks of one stage,
    whose replicated draws (residual dropout) must agree.
  * The default generators are read, not drawn from: the user's stream is what it would be
    without a pipeline.
  * Activation checkpointing's recompute replays it: `checkpoint` stashes the default state at
    the block's forward, which is then this stream's, and restores it for the recompute.
  * Checkpoints save and restore it beside the global state (parallel_layers/random_states.py),
    so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib

import torch

from parallel_layers import random_states
from parallel_layers.tensor_parallel import region_random

_SEED_STRIDE = 100  # Megatron's offset between pipeline ranks


class _Stream:
    def __init__(self):
        self.seed: int | None = None
        self.pp_rank = 0
        self.device = torch.device("cpu")  # the pipeline's: its CUDA state is the one a checkpoint saves
        self.states: dict[torch.device, torch.Tensor] = {}  # each device's state between stages
        # the CPU default state a checkpoint restored with these states: a `seed` that finds it
        # still in place (a pipeline built right after the load) keeps them, and the region
        # streams' that came with them
        self.loaded: torch.Tensor | None = None


_stream = _Stream()


def seed(pp_rank: int, device: torch.device | str) -> None:
    """Seed this rank's stage stream (Note [a random stream per pipeline stage]) from the default
    generators of the CPU and of `device`, and the TP region streams from it."""
    keys = _keys(torch.device(device))
    _stream.pp_rank = pp_rank
    _stream.seed = random_states.digest_seed(*(random_states.get_state(d) for d in keys)) + _SEED_STRIDE * pp_rank
    _stream.device = keys[-1]
    if _stream.loaded is not None and torch.equal(_stream.loaded, torch.get_rng_state()):
        return
    _stream.loaded = None
    _stream.states.clear()
    with active(device):
        region_random.reseed()


def _seed_again_after_tp() -> None:
    """TP applied after the pipeline was built: seed again from the state its group now shares."""
    if _stream.seed is not None:
        seed(_stream.pp_rank, _stream.device)


region_random.after_seed.append(_seed_again_after_tp)


def _keys(device: torch.device) -> list[torch.device]:
    cpu = torch.device("cpu")
    return [cpu] if device.type != "cuda" else [cpu, random_states.device_key(device)]


@contextlib.contextmanager
def active(device: torch.device | str):
    """Run with the stage stream as the default generators of the CPU and of `device`, then put
    back what they were (a no-op before `seed`)."""
    if _stream.seed is None:
        yield
        return
    keys = _keys(torch.device(device))
    _stream.loaded = None
    outer = {d: random_states.get_state(d) for d in keys}
    for d in keys:
        if d not in _stream.states:
            _stream.states[d] = random_states.fresh_state(d, _stream.seed)
        random_states.set_state(d, _stream.states[d])
    try:
        yield
    finally:
        for d in keys:
            _stream.states[d] = random_states.get_state(d)
            random_states.set_state(d, outer[d])


def state_dict() -> dict[str, torch.Tensor]:
    """For a checkpoint: this rank's stage states, keyed "pp_stage_<device type>" (the CPU and
    the pipeline's CUDA device)."""
    return random_states.to_entries("pp_stage", _stream.states, _cuda())


def load_state_dict(states: dict[str, torch.Tensor]) -> None:
    """Called by every restore, with no entries when the checkpoint holds no stage stream."""
    if not states:
        _stream.loaded = None
        return
    _stream.states.update(random_states.from_entries("pp_stage", states, _cuda()))
    _stream.loaded = torch.get_rng_state()  # the checkpoint restored the default states first


def _cuda() -> torch.device | None:
    """The pipeline's CUDA device (None: the current one)."""
    return _stream.device if _stream.device.type == "cuda" else None


random_states.register("pp_stage", state_dict, load_state_dict)  # saved in checkpoints
