"""ParallelDims validation and init_parallel's (pp, dp, tp) groups on real processes."""

import pytest
import torch
import torch.distributed as dist

from parallel_layers import ParallelDims, init_parallel
from tests.dist_harness import run_distributed


def test_dims_product_must_match_world_size():
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world_size 8; .* valid values are "
                                         r"\[1, 2, 4, 8\]"):
        ParallelDims(dp=2, tp=2, pp=3, world_size=8)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_dims_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match=f"tp must be a positive integer, got {bad}"):
        ParallelDims(dp=1, tp=bad, pp=1, world_size=1)


def test_infer_dp_and_its_error():
    assert ParallelDims.infer(8, tp=2, pp=2) == ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    with pytest.raises(ValueError, match=r"tp\(3\) \* pp\(1\) = 3 does not divide world_size 8"):
        ParallelDims.infer(8, tp=3)


def _groups(rank, ws, tp, pp):
    ctx = init_parallel(tp=tp, pp=pp, device="cpu")
    out = {axis: dist.get_process_group_ranks(ctx.group(axis)) for axis in ("pp", "dp", "tp")}
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.tp_group)  # the groups work
    out["tp_sum"] = t.item()
    out["coords"] = tuple(ctx.coordinate(a) for a in ("pp", "dp", "tp"))
    return out


def test_tp_is_innermost_and_pp_outermost():
    results = run_distributed(_groups, 8, args=(2, 2))
    for rank, r in enumerate(results):
        pp, rem = divmod(rank, 4)
        dp, tp = divmod(rem, 2)
        assert r["coords"] == (pp, dp, tp)
        assert r["tp"] == [rank - tp, rank - tp + 1]  # adjacent ranks
        assert r["dp"] == [pp * 4 + tp, pp * 4 + 2 + tp]
        assert r["pp"] == [dp * 2 + tp, 4 + dp * 2 + tp]
        assert r["tp_sum"] == 2
