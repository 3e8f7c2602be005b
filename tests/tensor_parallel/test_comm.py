"""The tensor-parallel region's autograd collectives: forward and backward of each, and the
identity at group size 1."""

import pytest
import torch
import torch.distributed as dist

from parallel_layers.tensor_parallel import comm
from tests.dist_harness import run_distributed


def _check_functions(rank, ws):
    group = dist.group.WORLD
    full = torch.arange(4.0 * ws * 3).reshape(4 * ws, 3)  # the same on every rank
    mine = full.chunk(ws, 0)[rank]
    cols = torch.arange(2.0 * 3 * ws).reshape(2, 3 * ws)
    results = {}

    x = torch.ones(2, 3, requires_grad=True)
    comm.copy_to_tp(x, group).backward(torch.full((2, 3), float(rank + 1)))
    results["copy_to_tp grad"] = x.grad[0, 0].item()  # all-reduced: sum of rank + 1

    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = comm.reduce_from_tp(x, group)
    y.backward(torch.ones(2, 3))
    results["reduce_from_tp"] = (y[0, 0].item(), x.grad[0, 0].item())

    x = cols.clone().requires_grad_()
    y = comm.scatter_to_tp(x, group)
    y.backward(torch.ones_like(y))
    results["scatter_to_tp"] = torch.equal(y, cols.chunk(ws, -1)[rank]) and torch.equal(x.grad, torch.ones_like(cols))

    x = cols.chunk(ws, -1)[rank].clone().requires_grad_()
    y = comm.gather_from_tp(x, group)
    y.backward(cols)
    results["gather_from_tp"] = torch.equal(y, cols) and torch.equal(x.grad, cols.chunk(ws, -1)[rank])

    x = mine.clone().requires_grad_()
    y = comm.gather_from_sp(x, group)
    y.backward(full)
    results["gather_from_sp"] = torch.equal(y, full) and torch.equal(x.grad, ws * mine)

    x = full.clone().requires_grad_()
    y = comm.reduce_scatter_to_sp(x, group)
    y.backward(torch.ones_like(y))
    results["reduce_scatter_to_sp"] = torch.equal(y, ws * mine) and torch.equal(x.grad, torch.ones_like(full))

    x = full.clone().requires_grad_()
    y = comm.scatter_to_sp(x, group)
    y.backward(torch.ones_like(y))
    results["scatter_to_sp"] = torch.equal(y, mine) and torch.equal(x.grad, torch.ones_like(full))
    return results


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_collectives_forward_and_backward(ws):
    for r in run_distributed(_check_functions, ws):
        total = ws * (ws + 1) / 2
        assert r["copy_to_tp grad"] == total
        assert r["reduce_from_tp"] == (total, 1.0)
        for name in ("scatter_to_tp", "gather_from_tp", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp"):
            assert r[name], name


def test_identity_without_process_group():
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp, comm.gather_from_sp,
               comm.reduce_scatter_to_sp, comm.scatter_to_sp):
        assert fn(x) is x


def _bad_split(rank, ws):
    try:
        comm.split(torch.randn(5, 2), 0, dist.group.WORLD)
    except ValueError as e:
        return str(e)


def test_uneven_split_error_on_every_rank():
    assert run_distributed(_bad_split, 2) == ["cannot split dim 0 of size 5 evenly over 2 ranks (shape (5, 2))"] * 2


def _mismatched_collective(rank, ws):
    import os

    os.environ["PARALLEL_LAYERS_DEBUG"] = "1"
    x = torch.ones(3 if rank == 0 else 4)  # rank 1 reduces a tensor of another shape
    try:
        comm.all_reduce(x, dist.group.WORLD)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_debug_mode_turns_a_mismatch_into_an_error_on_every_rank():
    expected = ("PARALLEL_LAYERS_DEBUG: ranks disagree on the next collective of group [0, 1]: "
                "rank 0: all_reduce (3,) torch.float32; rank 1: all_reduce (4,) torch.float32")
    assert run_distributed(_mismatched_collective, 2, timeout_s=60) == [expected, expected]


def _not_a_member(rank, ws):
    group = dist.new_group([0, 1])  # every rank must call new_group; rank 2 is not in it
    try:
        comm.group_size(group)
    except ValueError as e:
        return str(e)
    return "member"


def test_group_this_rank_is_not_in():
    results = run_distributed(_not_a_member, 3)
    assert results[:2] == ["member", "member"]
    assert results[2].startswith("rank 2 is not a member of the given process group (its ranks are [0, 1])")


def _check_seq_dim_one(rank, ws):
    """The sequence collectives on [batch, seq, hidden] (seq_dim=1): a batch of two (the strided
    copy of Note [strided sequence chunks]) and of one (the rank-major buffer itself)."""
    group = dist.group.WORLD
    results = {}
    for batch in (2, 1):
        full = torch.arange(batch * 2.0 * ws * 3).reshape(batch, 2 * ws, 3)  # the same on every rank
        chunk = full.chunk(ws, 1)[rank]
        own = full * (rank + 1)  # a gradient that differs between ranks
        total = ws * (ws + 1) / 2

        x = chunk.clone().requires_grad_()
        y = comm.gather_from_sp(x, group, seq_dim=1)
        y.backward(own)  # partial gradients: reduce-scattered
        results[f"gather b{batch}"] = (torch.equal(y, full) and y.is_contiguous()
                                       and torch.equal(x.grad, total * chunk))

        x = chunk.clone().requires_grad_()
        y = comm.gather_from_sp(x, group, 1, replicated_consumer=True)
        y.backward(own)  # this rank's chunk of its own gradient, nothing summed
        results[f"gather replicated b{batch}"] = torch.equal(x.grad, own.chunk(ws, 1)[rank])

        x = own.clone().requires_grad_()
        y = comm.reduce_scatter_to_sp(x, group, seq_dim=-2)
        y.backward(chunk * (rank + 1))  # all-gathered: rank r's chunk scaled by r + 1
        want_grad = torch.cat([c * (r + 1) for r, c in enumerate(full.chunk(ws, 1))], dim=1)
        results[f"reduce_scatter b{batch}"] = (torch.equal(y, total * chunk) and y.is_contiguous()
                                               and torch.equal(x.grad, want_grad))

        x = full.clone().requires_grad_()
        y = comm.scatter_to_sp(x, group, seq_dim=1)
        y.backward(chunk * (rank + 1))
        results[f"scatter b{batch}"] = torch.equal(y, chunk) and torch.equal(x.grad, want_grad)
    return results


def test_sequence_collectives_on_dim_one():
    for rank, results in enumerate(run_distributed(_check_seq_dim_one, 3)):
        assert len(results) == 8 and all(results.values()), (rank, results)
