"""Property-based tests (hypothesis) over random shapes, dtypes and world sizes: the fused
kernels against float64, and every shard/unshard round trip of the library - tensor-parallel
cuts (fused blocks included), ZeRO's flat shards through the copy kernels, and the pieces a
checkpoint stores. (The shard copy kernels' own properties are in tests/ops/test_shard_copy.py.)"""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import parallel_layers  # noqa: F401  (registers the ops)
from parallel_layers.ops import linear_gelu
from parallel_layers.ops.shard_copy import all_gather_copy_in, all_gather_copy_out, shard_numel
from parallel_layers.tensor_parallel.sharding import TPShard, shard, unshard
from tests.ops.numerics import assert_within_rounding

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
APPROX = ["none", "tanh"]


def _randn(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 40), cols=st.integers(0, 300), dtype=st.sampled_from(FLOATS),
       approximate=st.sampled_from(APPROX), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 10**6))
def test_bias_gelu_matches_float64(rows, cols, dtype, approximate, scale, seed):
    x, b = _randn((rows, cols), seed, scale).to(dtype), _randn((cols,), seed + 1, scale).to(dtype)
    y, z = torch.ops.parallel_layers.bias_gelu(x, b, approximate)
    z_ref = x.double() + b.double()
    assert_within_rounding(z, z_ref, torch.zeros_like(z_ref), ulps=0.5, what="pre-activation")
    assert_within_rounding(y, F.gelu(z_ref, approximate=approximate), z_ref, ulps=4, what="gelu")


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 70), k=st.integers(1, 90), n=st.integers(1, 70), bias=st.booleans(),
       approximate=st.sampled_from(APPROX), seed=st.integers(0, 10**6))
def test_linear_gelu_forward_and_backward_match_float64(m, k, n, bias, approximate, seed):
    x, w = _randn((m, k), seed), _randn((n, k), seed + 1) / k ** 0.5
    b = _randn((n,), seed + 2) if bias else None
    dy = _randn((m, n), seed + 3)
    ins32 = [t.float().requires_grad_() if t is not None else None for t in (x, w, b)]
    ins64 = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y32 = linear_gelu(*ins32, approximate=approximate)
    z64 = F.linear(*ins64)
    y64 = F.gelu(z64, approximate=approximate)
    # dz = dy * gelu'(z): gelu' cancels for negative z; its terms are O(|z|) (exact) and
    # O(|z|^3) (tanh), as in tests/ops/test_bias_gelu.py.
    dz = dy.abs() * (1 + z64.detach().abs()) ** 3
    (y32 * dy.float()).sum().backward()
    (y64 * dy).sum().backward()
    # Each result is a sum of products; float32 rounding is relative to the sum of the terms'
    # magnitudes (which may cancel in the result): |error| <= 1e-5 * (that sum + |result|).
    scales = {"y": x.abs() @ w.abs().T + (b.abs() if b is not None else 0), "x": dz @ w.abs(), "w": dz.T @ x.abs(),
              "b": dz.sum(0)}
    pairs = [("y", y32, y64)] + [(g, a.grad, r.grad) for g, a, r in zip("xwb", ins32, ins64) if a is not None]
    for what, got, ref in pairs:
        bound = 1e-5 * (scales[what] + ref.abs())
        assert ((got.double() - ref.detach()).abs() <= bound).all(), what


@st.composite
def tp_cut(draw):
    """A full tensor shape, the dim it is cut on, the number of parts and fused block sizes."""
    parts = draw(st.integers(1, 8))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    blocks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3).map(lambda bs: [b * parts for b in bs]))
    shape = [draw(st.integers(0, 5)) for _ in range(ndim)]
    shape[dim] = sum(blocks)
    return tuple(shape), dim, parts, tuple(blocks) if len(blocks) > 1 else None


@settings(max_examples=100, deadline=None)
@given(cut=tp_cut(), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 10**6))
def test_tensor_parallel_shard_unshard_round_trip(cut, dtype, seed):
    shape, dim, parts, fused = cut
    full = _randn(shape, seed).to(dtype)
    pieces = [shard(full, dim, parts, i, fused) for i in range(parts)]
    spec = TPShard(dim=dim, parts=parts, index=0, full_shape=shape, fused=fused)
    assert torch.equal(unshard(pieces, spec), full)
    # Each fused block is cut on its own: part i holds the i-th chunk of every block, in order.
    for i, piece in enumerate(pieces):
        expected = [blk.chunk(parts, dim)[i] if blk.shape[dim] else blk
                    for blk in full.split(list(fused or (shape[dim],)), dim)]
        assert torch.equal(piece, torch.cat(expected, dim))


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 7), max_size=3).map(tuple), min_size=1, max_size=5),
       world=st.integers(1, 8), param=st.sampled_from(FLOATS), gather=st.sampled_from(FLOATS),
       seed=st.integers(0, 10**6))
def test_zero_flat_shards_round_trip(shapes, world, param, gather, seed):
    # What ZeRO does to a group of parameters: cut each flattened (padded) into `world` shards,
    # every rank copies its shards into its slot of the gather buffer (cast to the gather dtype),
    # and the copy-out rebuilds every full parameter from the gathered buffer.
    fulls = [_randn(s, seed + i).to(param) for i, s in enumerate(shapes)]
    rows = []
    for rank in range(world):
        shards = []
        for t in fulls:
            s = shard_numel(t.numel(), world)
            flat = F.pad(t.reshape(-1), (0, s * world - t.numel()))
            shards.append(flat[rank * s:(rank + 1) * s])
        rows.append(all_gather_copy_in(shards, world, rank, gather)[rank])
    outs = [torch.empty(t.shape, dtype=param) for t in fulls]
    all_gather_copy_out(torch.stack(rows), outs)
    for t, o in zip(fulls, outs):
        assert torch.equal(o, t.to(gather).to(param))


@settings(max_examples=150, deadline=None)
@given(cut=tp_cut(), zero_world=st.one_of(st.none(), st.integers(1, 5)), crop=st.integers(0, 3),
       seed=st.integers(0, 10**6))
def test_checkpoint_pieces_cover_every_element_once(cut, zero_world, crop, seed):
    # Every (TP part, ZeRO rank) describes what it holds as pieces of the logical tensor
    # (parallel_layers/placement.py); together they must tile it exactly, and writing each
    # rank's local data into its pieces must rebuild the tensor. `crop` rows of dim 0 are
    # padding (as in the vocabulary-parallel embedding) and belong to no piece. Fused blocks
    # split on any dim are described under ZeRO too (Note [flat pieces]).
    from parallel_layers.placement import box_pieces, flat_pieces

    shape, dim, parts, fused = cut
    logical = (max(0, shape[0] - crop),) + shape[1:]
    full = _randn(shape, seed)
    full.narrow(0, logical[0], shape[0] - logical[0]).zero_()
    rebuilt = torch.full(logical, float("nan"), dtype=torch.float64)
    index = torch.arange(rebuilt.numel()).view(logical)
    hits = torch.zeros(rebuilt.numel(), dtype=torch.long)

    def box(t, piece):
        for d, (o, n) in enumerate(zip(piece.global_offsets, piece.sizes)):
            t = t.narrow(d, o, n)
        return t

    for i in range(parts):
        spec = TPShard(dim=dim, parts=parts, index=i, full_shape=shape, fused=fused)
        layout = spec.layout(logical_rows=logical[0] if crop else None)
        local = shard(full, dim, parts, i, fused)
        for r in range(zero_world or 1):
            store, pieces = local, box_pieces(layout)
            if zero_world is not None:
                s = -(-local.numel() // zero_world)
                store = F.pad(local.reshape(-1), (0, s * zero_world - local.numel()))[r * s:(r + 1) * s]
                pieces = flat_pieces(layout, tuple(local.shape), r * s, (r + 1) * s)
            for piece in pieces:
                box(rebuilt, piece).copy_(piece.view(store))
                hits += torch.bincount(box(index, piece).reshape(-1), minlength=hits.numel())
    assert (hits == 1).all()
    assert torch.equal(rebuilt, full.narrow(0, 0, logical[0]))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 60), k=st.integers(1, 90), n=st.integers(1, 70), bias=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), approximate=st.sampled_from(APPROX),
       seed=st.integers(0, 10**6))
def test_linear_gelu_16bit_no_worse_than_twice_eager(m, k, n, bias, dtype, approximate, seed):
    # The acceptance bound for 16-bit outputs; it caught a version that added the bias after
    # rounding the GEMM to 16 bits (two roundings: up to 7x eager's error).
    x, w = _randn((m, k), seed).to(dtype), (_randn((n, k), seed + 1) / k ** 0.5).to(dtype)
    b = _randn((n,), seed + 2).to(dtype) if bias else None
    with torch.no_grad():
        ours = linear_gelu(x, w, b, approximate=approximate)
        eager = F.gelu(F.linear(x, w, b), approximate=approximate)
    ref = F.gelu(F.linear(x.double(), w.double(), b.double() if bias else None), approximate=approximate)
    err = lambda t: (t.double() - ref).abs().max().item()  # noqa: E731
    assert err(ours) <= 2 * err(eager) + 1e-12
