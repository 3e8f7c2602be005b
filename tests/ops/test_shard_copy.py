"""Shard copy kernels against pure-PyTorch references (torch.cat / chunk / pad): random and
degenerate shapes (first dim < world size, size 1, empty), world sizes 1-8, dtype changes,
property-based with hypothesis, opcheck, and the CUDA kernels when a GPU is present."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import parallel_layers  # noqa: F401  (registers the ops)
from parallel_layers.ops.shard_copy import (
    all_gather_copy_in,
    all_gather_copy_out,
    reduce_scatter_copy_in,
    reduce_scatter_copy_out,
    shard_numel,
)
from tests.ops.numerics import devices

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ---- references -------------------------------------------------------------------------
def ref_shards(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    s = shard_numel(full.numel(), world)
    padded = F.pad(full.flatten(), (0, s * world - full.numel()))
    return list(padded.chunk(world)) if s else [padded.new_empty(0)] * world


def ref_gather_buffer(fulls, world, dtype):
    """What the all-gather produces: row r = rank r's shards, cast."""
    rows = [torch.cat([ref_shards(t, world)[r].to(dtype) for t in fulls]) if fulls else torch.empty(0, dtype=dtype)
            for r in range(world)]
    return torch.stack(rows)


def ref_reduce_scatter_in(grads, world, dtype, scale):
    return torch.stack([torch.cat([(ref_shards(g, world)[r].to(torch.float64) * scale).to(dtype) for g in grads])
                        if grads else torch.empty(0, dtype=dtype) for r in range(world)])


def _tensors(shapes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype) for shape in shapes]


SHAPES = [(7, 15), (15, 3), (1,), (3, 5), (0,), (2,), (1, 1, 4), (0, 3), (33,)]


# ---- all-gather -------------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("src, dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                      (torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_all_gather_round_trip(world, src, dst, device):
    fulls = _tensors(SHAPES, src, device)
    per_rank = [[ref_shards(t, world)[r] for t in fulls] for r in range(world)]
    # Each rank packs its shards into its row; the all-gather is simulated by merging rows.
    gathered = torch.empty(world, sum(shard_numel(t.numel(), world) for t in fulls), dtype=dst, device=device)
    for r in range(world):
        row = all_gather_copy_in(per_rank[r], world, r, dst)[r]
        gathered[r] = row
    torch.testing.assert_close(gathered, ref_gather_buffer(fulls, world, dst), rtol=0, atol=0)
    outs = [torch.full(t.shape, float("nan"), dtype=src, device=device) for t in fulls]
    all_gather_copy_out(gathered, outs)
    for t, o in zip(fulls, outs):
        # Back in the source dtype: exact unless the buffer dtype was narrower.
        torch.testing.assert_close(o, t.to(dst).to(src), rtol=0, atol=0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("carried, words", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                            (torch.float64, torch.float32)])
def test_a_copy_into_the_same_dtype_moves_bits_as_they_are(world, carried, words, device):
    """Note [carried bit for bit] (zero/_group.py): ZeRO gathers float32 adapters as a bfloat16
    buffer's words. Every bit pattern - words that read as NaNs, subnormals - comes back: the
    CUDA kernels copied through float, which rewrote a NaN-looking word as the canonical NaN
    (0.4% of random float32 values; review finding, helper-81), where the CPU's copy_ moves bytes."""
    g = torch.Generator().manual_seed(world)
    bits = torch.int32 if carried == torch.float32 else torch.int64
    fulls = [torch.randint(torch.iinfo(bits).min, torch.iinfo(bits).max, (n,), generator=g, dtype=bits)
             .view(carried).to(device) for n in (33, 4096, 1)]
    rows = []
    for r in range(world):
        shards = [ref_shards(t, world)[r].view(words) for t in fulls]  # a carried shard: the buffer's words
        rows.append(all_gather_copy_in(shards, world, r, words)[r])
    gathered = torch.stack(rows)  # the all-gather, simulated
    padded = [torch.empty(world * shard_numel(t.numel(), world), dtype=carried, device=device) for t in fulls]
    all_gather_copy_out(gathered, [t.view(words) for t in padded])
    for full, back in zip(fulls, padded):
        assert torch.equal(back[:full.numel()].view(bits), full.view(bits))


# ---- reduce-scatter ---------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("src, dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                      (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                                      (torch.bfloat16, torch.float16), (torch.float16, torch.float16)])
def test_reduce_scatter_copy_in_and_out(world, src, dst, device):
    grads = _tensors(SHAPES, src, device, seed=1)
    buf = reduce_scatter_copy_in(grads, world, dst, pre_scale=0.5)
    expected = ref_reduce_scatter_in([g.cpu() for g in grads], world, dst, 0.5)
    # Scaling runs in float32 (float64 if either side is float64), so compare with a float32 reference.
    expected32 = torch.stack([torch.cat([(ref_shards(g.cpu(), world)[r].float() * 0.5).to(dst) for g in grads])
                              for r in range(world)])
    torch.testing.assert_close(buf.cpu(), expected32, rtol=0, atol=0)
    torch.testing.assert_close(buf.cpu().double(), expected.double(), rtol=1e-2, atol=1e-6)  # same up to rounding
    for rank in range(world):
        shard_grads = [torch.ones(shard_numel(g.numel(), world), dtype=torch.float32, device=device) for g in grads]
        reduce_scatter_copy_out(buf[rank], shard_grads, post_scale=2.0, accumulate=True)
        for g, sg in zip(grads, shard_grads):
            want = 1.0 + 2.0 * (ref_shards(g.cpu(), world)[rank].float() * 0.5).to(dst).float()
            torch.testing.assert_close(sg.cpu(), want, rtol=1e-6, atol=1e-6)  # one float32 rounding of 1 + x


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("src, dst", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                      (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_scaling_between_16_bit_dtypes_rounds_once(src, dst, accumulate, device):
    # helper-61: the CPU product was taken in the source's 16-bit dtype, then rounded into the
    # buffer's: a float16 60000 * 2 became inf (bfloat16 holds 119808), 1e-7 went subnormal
    # (19% off), 1/3 of a bfloat16 was rounded twice. helper-65: accumulating, add_(src, alpha)
    # took alpha in the 16-bit dtype (1/3 as 0.333984). CUDA's float accumulator never did either.
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor([60000.0, 1.0009765625, 3e-5, 1e-4, -7.5, 0.3]),
                        torch.randn(4096, generator=g)]).to(device, src)
    if dst == torch.float16:
        values = values.clamp(max=30000)  # within float16 after the scale
    start = torch.randn(values.shape, generator=g).to(device, dst)
    for scale in (2.0, 1 / 1024, 1 / 3):
        want = (values.double() * scale).to(dst)  # one rounding of the exact product
        buf = reduce_scatter_copy_in([values], 1, dst, pre_scale=scale)
        torch.testing.assert_close(buf[0], want, rtol=0, atol=0)
        out = start.clone() if accumulate else torch.zeros(values.shape, dtype=dst, device=device)
        reduce_scatter_copy_out(values, [out], post_scale=scale, accumulate=accumulate)
        if accumulate:  # the float32 sum of the float32 product, rounded once
            want = start.float().add(values.float(), alpha=scale).to(dst)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices())
def test_reduce_scatter_copy_out_overwrites(device):
    reduced = torch.arange(5.0, device=device)
    a, b = torch.full((2,), 9.0, device=device), torch.full((3,), 9.0, device=device)
    reduce_scatter_copy_out(reduced, [a, b], post_scale=3.0, accumulate=False)
    assert a.tolist() == [0.0, 3.0] and b.tolist() == [6.0, 9.0, 12.0]


# ---- property-based ---------------------------------------------------------------------
shape_st = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


def check_all_ops(fulls, world, rank, src, dst, device="cpu"):
    """All four ops on `fulls` (tensors of dtype src) against the references, exactly."""
    full_buf = ref_gather_buffer([t.cpu() for t in fulls], world, dst)
    buf = all_gather_copy_in([ref_shards(t, world)[rank] for t in fulls], world, rank, dst)
    torch.testing.assert_close(buf[rank].cpu(), full_buf[rank], rtol=0, atol=0)
    outs = [torch.empty(t.shape, dtype=src, device=device) for t in fulls]
    all_gather_copy_out(full_buf.to(device), outs)
    for t, o in zip(fulls, outs):
        torch.testing.assert_close(o, t.to(dst).to(src), rtol=0, atol=0)
    rs = reduce_scatter_copy_in(fulls, world, dst, pre_scale=1.0)
    torch.testing.assert_close(rs.cpu(), ref_reduce_scatter_in([t.cpu() for t in fulls], world, dst, 1.0),
                               rtol=0, atol=0)
    # Scatter then gather again: every element lands back where it came from.
    shard_grads = [torch.empty(shard_numel(t.numel(), world), dtype=dst, device=device) for t in fulls]
    reduce_scatter_copy_out(rs[rank], shard_grads)
    for t, sg in zip(fulls, shard_grads):
        torch.testing.assert_close(sg, ref_shards(t, world)[rank].to(dst), rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(shape_st, min_size=1, max_size=6), world=st.integers(1, 8),
       src=st.sampled_from(DTYPES), dst=st.sampled_from(DTYPES), data=st.data())
def test_property_all_ops_match_reference(shapes, world, src, dst, data):
    fulls = _tensors(shapes, src, "cpu", seed=data.draw(st.integers(0, 1000)))
    check_all_ops(fulls, world, data.draw(st.integers(0, world - 1)), src, dst)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("world, rank", [(1, 0), (3, 2), (8, 5)])
def test_many_tensors_span_launch_groups(world, rank, device):
    # The CUDA ops launch once per group of 64 tensors (Note [shard tables by value]): 150
    # tensors make three groups. Empty tensors start and end the first two groups and make a
    # run inside the second; the third group is all empty (no launch).
    shapes = [((i * 7) % 13 + 1, (i % 3) + 1) for i in range(150)]
    for i in (0, 1, 62, 63, 64, 65, 127) + tuple(range(90, 100)) + tuple(range(128, 150)):
        shapes[i] = (0,)
    check_all_ops(_tensors(shapes, torch.float32, device, seed=3), world, rank, torch.float32, torch.bfloat16,
                  device)


# ---- opcheck and errors -----------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    fulls = _tensors([(3, 4), (5,), (0,)], torch.float32, device)
    world = 2
    shards = [ref_shards(t, world)[1].contiguous() for t in fulls]
    total = sum(s.numel() for s in shards)
    ops = torch.ops.parallel_layers
    torch.library.opcheck(ops.all_gather_copy_in.default,
                          (shards, torch.zeros(world, total, dtype=torch.bfloat16, device=device), 1))
    torch.library.opcheck(ops.all_gather_copy_out.default,
                          (torch.randn(world, total, device=device), [torch.empty_like(t) for t in fulls]))
    torch.library.opcheck(ops.reduce_scatter_copy_in.default,
                          (fulls, torch.empty(world, total, device=device), 0.25))
    torch.library.opcheck(ops.reduce_scatter_copy_out.default,
                          (torch.randn(total, device=device), [torch.zeros_like(s) for s in shards], 2.0, True))


def test_bad_inputs():
    ops = torch.ops.parallel_layers
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[2, 5\] buffer"):
        ops.all_gather_copy_in([torch.randn(2), torch.randn(3)], torch.empty(2, 4), 0)
    with pytest.raises(RuntimeError, match=r"rank 2 is outside \[0, 2\)"):
        ops.all_gather_copy_in([torch.randn(2)], torch.empty(2, 2), 2)
    with pytest.raises(RuntimeError, match=r"all shards must have one dtype: shards\[0\] is Float but shards\[1\] is "
                                           r"Double"):
        ops.all_gather_copy_in([torch.randn(2), torch.randn(2, dtype=torch.float64)], torch.empty(1, 4), 0)
    with pytest.raises(RuntimeError, match=r"outs\[0\] must be contiguous"):
        ops.all_gather_copy_out(torch.empty(2, 3), [torch.empty(3, 2).t()])
    with pytest.raises(RuntimeError, match=r"reduced must be a contiguous \[3\] tensor"):
        ops.reduce_scatter_copy_out(torch.empty(4), [torch.empty(3)], 1.0, False)
    with pytest.raises(ValueError, match=r"rank 3 is outside \[0, 2\)"):
        all_gather_copy_in([torch.randn(2)], 2, 3, torch.float32)
