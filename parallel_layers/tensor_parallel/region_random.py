"""A random stream of each rank's own for the draws inside tensor-parallel regions.

Note [a random stream per rank inside TP regions]: outside the TP regions the ranks of a TP
group compute replicated values and must draw the same numbers (Note [one random stream per
tensor-parallel group] in plan.py: dropout on the residual stream, a router's jitter). Inside a
region - from a column-parallel layer's sharded output to the row-parallel layer that consumes
it - each rank holds different heads (or MLP columns), and a draw there must differ by rank: with
the shared stream, attention dropout over rank 0's heads drew the very masks rank 1 drew over
its own, so heads h and h + H/tp were dropped together, which no single-device model does.
Megatron keeps a second, per-rank stream for those draws (its model-parallel RNG tracker); so do
we:

  * `seed(tp_group)` (parallelize at tp > 1, after the group's stream is shared) seeds this
    rank's region stream with a digest of the shared CPU state - the same on every rank of the
    group, different per data-parallel replica - plus the TP rank;
  * a column layer's forward hook `enter`s the region (the default generator of its output's
    device takes this rank's region state; the shared state is set aside), the row layer's
    forward pre-hook `leave`s it (the region state is kept, the shared one restored), and so does
    the parent module's forward pre- and post-hook, so that no path leaves a region open:
    GPT-2's attention drops its probabilities inside the region (per rank) and its output after
    c_proj outside it (shared);
  * a recompute under activation checkpointing replays the block's region draws (`snapshot`
    before the block's forward, `replaying` around the recompute), as torch.utils.checkpoint
    replays the global stream; checkpoints save and restore the region state beside the global
    one (registered with parallel_layers/random_states.py), so a resumed run draws what an
    uninterrupted one would.

Only regions that drop something get the hooks (`draws`: an nn.Dropout of p > 0, or a
transformers attention's `attention_dropout` > 0); Llama, Mistral and Qwen train with neither.
A recompute by another checkpoint (transformers' gradient_checkpointing_enable()) cannot replay
the region stream: a region entered inside backward outside ours raises, naming the fix.

One generator per device: the CPU's for CPU tensors, the current CUDA device's for CUDA ones. A
region stream is created for a device the first time a region runs there.

Note [draws under sequence parallelism]: with the sequence split between the regions, what a
rank holds there is its own chunk of the positions, not a replica: GPT-2's residual dropout over
rank 0's positions drew the very masks rank 1 drew over its own (positions i and i + seq / tp
dropped together). So under sequence parallelism the split is the other way round: a decoder
layer that drops anything runs in this rank's stream (`install_sequence_parallel`: its forward
enters the stream, and leaves it at its end, also when it raises), except where its values are
replicated - from a region's entry, which gathers the sequence, to its column layers' sharded
outputs (a router's jitter over the gathered tokens, a region whose columns gather their outputs:
the shared stream), and from a row layer's input to its output, reduce-scattered on the sequence
(this rank's chunk again). Megatron draws its sequence-parallel dropout from the model-parallel
stream too. Outside the decoder layers nothing changes: the embedding's dropout, before the split,
draws one mask over the whole sequence from the shared stream. The layer's forward, not a hook,
enters the stream, so that activation checkpointing's recompute (which runs the forward between
the hooks: Note [checkpoint inside the hooks]) replays it with the rest. A forward that runs
without the split (Note [a forward without the sequence split] in comm.py: no gradients, a
length tp does not divide) draws as plain tensor parallelism does - the shared stream except
between the column layers' sharded outputs and the row layers - since its residual stream is
replicated (with this rank's stream, a train-mode generate() dropped differently on each rank:
review finding).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils import _pytree as pytree

from parallel_layers import random_states
from parallel_layers.tensor_parallel import comm

_OFFSET = 2718  # apart from any seed the caller gave the shared stream (Megatron's offset)


class _Streams:
    """This process's region streams: the seed, each device's region state while outside a
    region, the shared state set aside while inside one, and whether a recompute of ours runs."""

    def __init__(self):
        self.seed: int | None = None
        self.tp_rank = 0
        self.region: dict[torch.device, torch.Tensor] = {}
        self.outer: dict[torch.device, torch.Tensor] = {}
        self.replaying = False


_streams = _Streams()


_get, _set, _key = random_states.get_state, random_states.set_state, random_states.device_key

# Called at the end of `seed`, once the TP group shares its stream: a pipeline built before TP
# (against parallelize's order) seeds its stage stream again from the shared state
# (pipeline/stage_random.py, which registers here: this module does not know pipelines).
after_seed: list = []


def seed(tp_group) -> None:
    """Seed this rank's region streams (at tp > 1, once the group shares one stream): a digest of
    the shared CPU state, the same on every rank of the group, plus the TP rank. The shared
    stream is read, not drawn from: the model's replicated draws stay what they would be."""
    _streams.tp_rank = comm.group_rank(tp_group)
    _seed_from_default()
    for fn in after_seed:
        fn()


def reseed() -> None:
    """`seed` again, with the TP rank it was given, from the stream that is the default now (a
    pipeline stage's: Note [a random stream per pipeline stage] in pipeline/stage_random.py);
    nothing before `seed`."""
    if _streams.seed is not None:
        _seed_from_default()


def _seed_from_default() -> None:
    _streams.seed = random_states.digest_seed(torch.get_rng_state()) + _OFFSET + _streams.tp_rank
    _streams.region.clear()
    _streams.outer.clear()


def _region_state(device: torch.device) -> torch.Tensor:
    if device not in _streams.region:
        _streams.region[device] = random_states.fresh_state(device, _streams.seed)
    return _streams.region[device]


def enter(device: torch.device) -> None:
    """This rank's region stream becomes `device`'s default generator (no-op inside a region,
    or before `seed`)."""
    device = _key(device)
    if _streams.seed is None or device in _streams.outer:
        return
    if torch._C._current_graph_task_id() != -1 and not _streams.replaying:
        raise RuntimeError(
            "a tensor-parallel region with dropout ran its forward inside backward, outside parallel_layers' "
            "activation checkpointing: a recompute by another checkpoint (transformers' "
            "gradient_checkpointing_enable(), torch.utils.checkpoint around a block) would draw this rank's "
            "region dropout masks from where its stream is now, not where the forward drew them, and train on "
            "gradients of other masks (Note [a random stream per rank inside TP regions]). Checkpoint through "
            "parallelize(..., activation_checkpointing='full' or 'selective'), which replays them")
    region = _region_state(device)
    _streams.outer[device] = _get(device)
    _set(device, region)


def leave(device: torch.device | None = None) -> None:
    """Back to the shared stream on `device` (every device when None); no-op outside a region."""
    for d in [_key(device)] if device is not None else list(_streams.outer):
        if d in _streams.outer:
            _streams.region[d] = _get(d)
            _set(d, _streams.outer.pop(d))


def snapshot() -> dict[torch.device, torch.Tensor]:
    """The region streams' states now (before a checkpointed block's forward)."""
    leave()
    return {d: s.clone() for d, s in _streams.region.items()}


@contextlib.contextmanager
def replaying(states: dict[torch.device, torch.Tensor]):
    """Run with the region streams at `states` (a recompute), then put back what they were."""
    leave()
    now, was = dict(_streams.region), _streams.replaying
    # no tensor op here: a recompute under selective checkpointing counts the ops it replays
    # (the states are never written in place: a region's exit stores a new tensor). A device
    # whose stream did not exist yet at the snapshot (the first step's first block) starts
    # afresh from the seed, as that forward's did.
    _streams.region = dict(states)
    _streams.replaying = True
    try:
        yield
    finally:
        leave()
        _streams.region, _streams.replaying = now, was


def state_dict() -> dict[str, torch.Tensor]:
    """For a checkpoint: this rank's region states, keyed "tp_region_<device type>" (the CPU
    and the current CUDA device)."""
    leave()
    return random_states.to_entries("tp_region", _streams.region)


def load_state_dict(states: dict[str, torch.Tensor]) -> None:
    leave()
    _streams.region.update(random_states.from_entries("tp_region", states))


_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")  # Hugging Face attention's rates


def draws(parent: torch.nn.Module, skip: frozenset[int] = frozenset()) -> bool:
    """Whether a region's module drops anything: an nn.Dropout of p > 0 in it, or a module in
    it with a dropout rate > 0 it passes to its attention function (transformers'
    `attention_dropout`); modules whose id is in `skip` are not looked at. Regions without are
    left unhooked: nothing to draw, nothing to swap."""
    def drops(m: torch.nn.Module) -> bool:
        rates = [getattr(m, name, None) for name in _DROPOUT_ATTRIBUTES]
        return (isinstance(m, torch.nn.Dropout) and m.p > 0) or any(isinstance(r, float) and r > 0 for r in rates)
    return any(drops(m) for m in parent.modules() if id(m) not in skip)


def install(parent: torch.nn.Module, columns: list[torch.nn.Module], rows: list[torch.nn.Module]) -> None:
    """The hooks of one region: `parent` holds its column layers (sharded outputs) and the row
    layers that consume them."""
    for column in columns:
        column.register_forward_hook(lambda m, args, out: _enter_at(out))
    for row in rows:
        row.register_forward_pre_hook(lambda m, args: leave())
    parent.register_forward_pre_hook(lambda m, args: leave())
    # always_call: also when the forward raises inside the region (a caught out-of-memory error,
    # say), whose stream would otherwise draw the next forward's replicated dropout
    parent.register_forward_hook(lambda m, args, out: leave(), always_call=True)


def install_sequence_parallel(layer: torch.nn.Module, regions: list[torch.nn.Module],
                              columns: list[torch.nn.Module], rows: list[torch.nn.Module]) -> None:
    """The draws of one decoder layer under sequence parallelism (Note [draws under sequence
    parallelism]): `regions` are the modules inside it that gather the sequence at their entry,
    `columns` their column layers with sharded outputs, `rows` their row layers (which
    reduce-scatter on the sequence)."""
    layer._pl_stream_forward = layer.forward  # the class's, or an instance override (fused.py's)
    # a partial over the layer, as activation_checkpointing.py's: a deep copy calls its own
    layer.forward = functools.partial(_in_rank_stream, layer)
    for region in regions:
        region.register_forward_pre_hook(lambda m, args: leave())
        region.register_forward_hook(lambda m, args, out: _enter_at_split(out))
    for column in columns:
        column.register_forward_hook(lambda m, args, out: _enter_at(out))
    for row in rows:
        row.register_forward_pre_hook(lambda m, args: leave())
        row.register_forward_hook(lambda m, args, out: _enter_at_split(out))


def _enter_at_split(tree) -> None:
    """This rank's stream where the sequence is split: not in a forward without the split, whose
    values there are replicated (see the Note)."""
    if not comm.whole_sequence():
        _enter_at(tree)


def _in_rank_stream(layer: torch.nn.Module, *args, **kwargs):
    _enter_at_split((args, kwargs))
    try:
        return layer._pl_stream_forward(*args, **kwargs)
    finally:  # also when the forward raises: the next forward's replicated draws stay shared
        leave()


def _enter_at(tree) -> None:
    """`enter` on the device of the first tensor in `tree` (none: nothing to draw for)."""
    tensor = next((t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)), None)
    if tensor is not None:
        enter(tensor.device)


random_states.register("tp_region", state_dict, load_state_dict)  # saved in checkpoints
