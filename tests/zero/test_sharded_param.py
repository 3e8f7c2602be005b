"""ShardedParam: shard sizes, async unshard, reshard freeing storage, gradients into the shard."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_layers.zero import ShardedParam
from tests.dist_harness import run_distributed


def _round_trip(rank, ws):
    torch.manual_seed(0)
    full = torch.randn(7, 15)  # first dim smaller than some world sizes; 105 elements
    weight = torch.nn.Parameter(full.clone())
    sp = ShardedParam(weight, dist.group.WORLD)
    out = {"shard numel": sp.shard.numel(), "freed": weight.untyped_storage().size() == 0,
           "shard values": torch.equal(sp.shard, F.pad(full.flatten(), (0, sp.shard.numel() * ws - 105))
                                       .chunk(ws)[rank])}
    handle = sp.unshard(async_op=True)
    handle.wait()
    out["gathered"] = torch.equal(weight.detach(), full) and sp.is_unsharded
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(rank))
    (x @ weight).sum().backward()  # a different gradient on every rank
    sp.reduce_grad()
    out["full grad freed"] = weight.grad is None
    grads = [torch.zeros(7, 15) for _ in range(ws)]
    dist.all_gather(grads, (torch.randn(3, 7, generator=torch.Generator().manual_seed(rank)).t()
                            @ torch.ones(3, 15)).contiguous())
    mean = torch.stack(grads).mean(0)
    want = F.pad(mean.flatten(), (0, sp.shard.numel() * ws - 105)).chunk(ws)[rank]
    out["shard grad"] = torch.allclose(sp.shard.grad, want, rtol=1e-6, atol=1e-6)  # float32 sum order
    sp.reshard()
    out["freed again"] = weight.untyped_storage().size() == 0 and not sp.is_unsharded
    return out


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_sharded_param_round_trip(ws):
    for r in run_distributed(_round_trip, ws):
        assert r.pop("shard numel") == -(-105 // ws)
        assert all(r.values()), r
