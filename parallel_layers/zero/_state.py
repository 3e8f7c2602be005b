"""ZeRO's state as others read it: the placement description (parallel_layers/placement.py),
full and sharded state dicts, and the bytes each part holds. Functions of the ZeRO wrapper,
behind its methods of the same names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel_layers import _grad_bank, fault, placement

if TYPE_CHECKING:
    from parallel_layers.zero.api import ZeRO


def state_placement(zero: ZeRO, prefix: str = "") -> placement.ModelPlacement:
    described = placement.describe(zero.module, prefix)
    sharded = {id(sp.full): sp for g in zero.groups for sp in g.members}
    for tp in described.tensors.values():
        sp = sharded.get(id(tp.local))
        if sp is None:
            continue
        start = sp.rank * sp.shard_numel
        tp.pieces = placement.flat_pieces(placement.local_layout(tp.local), tuple(tp.local.shape), start,
                                          start + sp.shard_numel)
        tp.local = sp.shard
    described.shard_group = zero.group if zero.group is not None else dist.group.WORLD
    described.after_load.append(lambda: shards_replaced(zero))
    return described


def shards_replaced(zero: ZeRO) -> None:
    """The master shards were overwritten (a checkpoint load): the full parameters follow."""
    for g in zero.groups:
        g.drop_prefetch()
        if g.keep_full:
            g.refresh_full()
        else:
            g.reshard()


def materialize(zero: ZeRO, device) -> None:
    from parallel_layers.meta import materialize_module

    for g in zero.groups:
        for sp in g.members:
            sp.materialize(device)
    materialize_module(zero.module, device)  # what is left: buffers
    # the storage sizes the pool keeps memory of, now that the parameters have storage (on the
    # meta device a fused MLP's gate and up had none to share; review finding: nothing was kept)
    for pool in {id(g.pool): g.pool for g in zero.groups if g.pool is not None}.values():
        pool.keep_blocks.clear()
        pool.expect_units([g.members for g in zero.groups if g.pool is pool])


def full_state_dict(zero: ZeRO) -> dict[str, torch.Tensor]:
    for g in zero.groups:
        g.refresh_full()
    state = {k: v.detach().clone() for k, v in zero.module.state_dict().items()}
    for name, p in zero.module.named_parameters():
        group = placement.expert_group(p)
        if group is not None and name in state:  # one rank's experts: every rank's, in rank order (dim 0)
            parts = [torch.empty_like(state[name]) for _ in range(dist.get_world_size(group))]
            with fault.collective("ZeRO full state dict: experts all_gather", group):
                dist.all_gather(parts, state[name].contiguous(), group=group)
            state[name] = torch.cat(parts)
    for g in zero.groups:
        if not g.keep_full:
            g.reshard()
    return state


def _world_and_rank(zero: ZeRO) -> tuple[int, int]:
    if zero.group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(zero.group), dist.get_rank(zero.group)


def sharded_state_dict(zero: ZeRO) -> dict:
    shards = {f"{g.name}/{i}": s.detach().clone() for g in zero.groups for i, s in enumerate(g.shards)}
    world, rank = _world_and_rank(zero)
    return {"world_size": world, "rank": rank, "shards": shards, "optimizer": zero.optimizer.state_dict()}


def _sharded_state_problem(zero: ZeRO, state) -> str | None:
    """Why `state` cannot be loaded on this rank, or None."""
    keys = ("world_size", "rank", "shards", "optimizer")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        found = list(state)[:10] if isinstance(state, dict) else type(state).__name__
        return (f"load_sharded_state_dict expects the dict sharded_state_dict() returns, with keys {list(keys)}; "
                f"got {found}")
    world, _ = _world_and_rank(zero)
    if state["world_size"] != world:
        return (f"sharded state dict was saved at world size {state['world_size']}, this ZeRO runs at {world}; "
                "load the full state dict instead to change the world size")
    for g in zero.groups:
        for i, s in enumerate(g.shards):
            key = f"{g.name}/{i}"
            if key not in state["shards"] or state["shards"][key].shape != s.shape:
                return (f"sharded state dict has no shard {key!r} of shape {tuple(s.shape)}; was it saved with "
                        "another model or wrap policy?")
    return None


def load_sharded_state_dict(zero: ZeRO, state: dict) -> None:
    # Each rank reads its own file, so a bad one may be on one rank only: agree first, so
    # that every rank raises instead of the others waiting in the all-gather below.
    problem = _sharded_state_problem(zero, state)
    problems = [problem]
    world, _ = _world_and_rank(zero)
    if world > 1:
        problems = [None] * world
        with fault.collective("ZeRO sharded state check all_gather_object", zero.group):
            dist.all_gather_object(problems, problem, group=zero.group)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        raise ValueError(problem if problem is not None else
                         "load_sharded_state_dict failed on rank(s) " + "; ".join(f"{r}: {p}" for r, p in failed))
    for g in zero.groups:
        for i, s in enumerate(g.shards):
            with torch.no_grad():
                s.copy_(state["shards"][f"{g.name}/{i}"])
    zero.optimizer.load_state_dict(state["optimizer"])
    shards_replaced(zero)


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_bytes(zero: ZeRO) -> dict[str, int]:
    members = [sp for g in zero.groups for sp in g.members]
    # A master shard that is a view of its full parameter (ZeRO-1/2) costs nothing extra.
    masters = sum(_bytes(sp.shard) for sp in members if not sp.aliases_full)
    opt = sum(_bytes(t) for st in zero.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0)
    # each allocation once: gate and up of a packed SwiGLU MLP share one (parallel_layers/fused.py),
    # which was counted per member (review finding, helper-48); a freed one holds no bytes
    storages = {}
    for sp in members:
        storage = sp.full.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    pools = {id(g.pool): g.pool for g in zero.groups if g.pool is not None}.values()
    return {"params": sum(storages.values()),
            "grads": sum(_bytes(sp.full.grad) + _bytes(_grad_bank.banked(sp.full)) for sp in members),
            "master_shards": masters,
            "shard_grads": sum(_bytes(sp.shard.grad) for sp in members),
            "optimizer_state": opt,
            # kept for reuse on the CPU: gather / reduce buffers and freed parameters' memory (Note
            # [CPU buffer reuse], Note [CPU parameter storage reuse] in _group.py)
            "pooled": sum(pool.idle_bytes + pool.idle_storage_bytes for pool in pools)}
