"""VocabParallelEmbedding, the tied vocab-parallel head and cross-entropy against
nn.Embedding + F.linear + F.cross_entropy, with a vocabulary that needs padding."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.tensor_parallel import (
    VocabParallelEmbedding,
    gather_full,
    reduce_grad_over_tp,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from parallel_layers.tensor_parallel.comm import all_gather
from tests.dist_harness import run_distributed

VOCAB, DIM, SEQ, BATCH = 50, 8, 12, 2  # 50 = padded to 51 at tp=3 and 52 at tp=4
RTOL = 1e-5  # float32; the only difference is the order of the softmax sums over shards


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _lm_parity(rank, ws, sequence_parallel, padding_idx, vocab=VOCAB):
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref_emb = nn.Embedding(vocab, DIM, padding_idx=padding_idx)
    ref_mix = nn.Linear(DIM, DIM)
    emb = VocabParallelEmbedding.from_embedding(ref_emb, tp_group=group, sequence_parallel=sequence_parallel)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (SEQ, BATCH), generator=g)
    ids[0, 0] = padding_idx if padding_idx is not None else 0  # the lookup of a padding id adds no gradient
    target = torch.randint(0, vocab, (SEQ, BATCH), generator=g)
    target[1, :] = -100  # ignored positions

    h_ref = torch.tanh(ref_mix(ref_emb(ids)))
    logits_ref = F.linear(h_ref, ref_emb.weight)
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, vocab), target.reshape(-1), ignore_index=-100)
    loss_ref.backward()
    mix_grad_ref = ref_mix.weight.grad.clone()
    ref_mix.zero_grad()

    if sequence_parallel:
        # A replicated layer that sees only this rank's sequence chunk: its gradient is
        # partial and must be summed over TP (as for LayerNorm under SP).
        for p in ref_mix.parameters():
            reduce_grad_over_tp(p, group)
    h = torch.tanh(ref_mix(emb(ids)))  # [SEQ (/ tp under SP), BATCH, DIM]
    local_logits = vocab_parallel_logits(h, emb)
    loss = vocab_parallel_cross_entropy(local_logits, target, emb)
    loss.backward()
    full_logits = all_gather(local_logits.detach(), -1, group)[..., :vocab]
    emb_grad = gather_full(emb.weight.grad, group, emb.weight.tp_shard)[:vocab]
    return {"loss": abs(loss.item() - loss_ref.item()) / loss_ref.item(),
            "logits": _rel(full_logits, logits_ref.detach()),
            "grad embedding": _rel(emb_grad, ref_emb.weight.grad),
            "grad mix": _rel(ref_mix.weight.grad, mix_grad_ref)}


@pytest.mark.parametrize("padding_idx", [None, 7])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_lm_head_and_loss_match_single_process(tp, sequence_parallel, padding_idx):
    for rank, r in enumerate(run_distributed(_lm_parity, tp, args=(sequence_parallel, padding_idx))):
        bad = {k: v for k, v in r.items() if not v < RTOL}
        assert not bad, f"rank {rank}: {bad}"


def test_a_rank_whose_rows_are_all_padding_adds_nothing_to_the_loss():
    """Review finding (helper-56): a vocabulary of 5 at tp=4 (rows of 2; rank 3's both padding)
    gave every rank a NaN loss - that rank's target logit was -inf * 0 - with finite gradients."""
    for rank, r in enumerate(run_distributed(_lm_parity, 4, args=(False, None, 5))):
        bad = {k: v for k, v in r.items() if not v < RTOL}
        assert not bad, f"rank {rank}: {bad}"


def test_reductions_and_errors_single_process():
    emb = VocabParallelEmbedding(10, 4)
    logits = torch.randn(3, 10, requires_grad=True)
    target = torch.tensor([1, -100, 9])
    for reduction in ("mean", "sum", "none"):
        ours = vocab_parallel_cross_entropy(logits, target, emb, reduction=reduction)
        torch.testing.assert_close(ours, F.cross_entropy(logits, target, reduction=reduction))
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        vocab_parallel_cross_entropy(logits, target, emb, reduction="avg")
    with pytest.raises(ValueError, match=r"expected logits \[\*target.shape, 10\]"):
        vocab_parallel_cross_entropy(logits[:, :5], target, emb)
    with pytest.raises(IndexError, match=r"ids must be in \[0, 10\), got values in \[0, 12\]"):
        emb(torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 10\), got 10"):
        VocabParallelEmbedding(10, 4, padding_idx=10)


def test_range_checks_on_a_device_assert_what_the_cpu_checks_raise(monkeypatch):
    """Note [range checks on a device]: the conditions handed to the asynchronous device-side
    assert (CUDA only), recorded here on CPU tensors: false exactly where the CPU's check raises."""
    from parallel_layers.tensor_parallel import vocab

    seen = []
    monkeypatch.setattr(vocab, "_assert_on_device",
                        lambda values, valid, message: seen.append((bool(valid().all()), message)))
    emb = VocabParallelEmbedding(10, 4)
    logits = torch.randn(4, 10)
    emb(torch.tensor([0, 9]))
    vocab_parallel_cross_entropy(logits, torch.tensor([0, 9, -100, 3]), emb)
    vocab_parallel_cross_entropy(logits, torch.tensor([0, 9, -1, 3]), emb, ignore_index=-1)
    assert [ok for ok, _ in seen] == [True, True, True]
    seen.clear()
    for call in (lambda: emb(torch.tensor([0, 10])), lambda: emb(torch.tensor([-1, 3])),
                 lambda: vocab_parallel_cross_entropy(logits, torch.tensor([0, 10, -100, 3]), emb),
                 lambda: vocab_parallel_cross_entropy(logits, torch.tensor([0, -100, 1, 3]), emb, ignore_index=-1)):
        with pytest.raises(IndexError):  # the CPU's own check, after the device one
            call()
    assert [ok for ok, _ in seen] == [False, False, False, False]
    assert seen[0][1] == "VocabParallelEmbedding: ids must be in [0, 10)"
    assert seen[3][1] == "vocab_parallel_cross_entropy: targets must be in [0, 10) or ignore_index (-1)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_an_out_of_vocabulary_id_on_cuda_stops_the_job_at_its_next_sync():
    """On a GPU the check is a device-side assert (no sync each step): the process fails at its
    next sync instead of training on a silently wrong loss. Run in a subprocess: the assert
    leaves that process's CUDA context unusable."""
    import pathlib
    import subprocess
    import sys

    script = ("import torch\nfrom parallel_layers.tensor_parallel import VocabParallelEmbedding, "
              "vocab_parallel_cross_entropy\nemb = VocabParallelEmbedding(10, 4).cuda()\n"
              "logits = torch.randn(2, 10, device='cuda')\n"
              "vocab_parallel_cross_entropy(logits, torch.tensor({target}, device='cuda'), emb)\n"
              "emb(torch.tensor({ids}, device='cuda'))\ntorch.cuda.synchronize()\nprint('done')\n")
    for ids, target, ok in (([0, 9], [1, -100], True), ([0, 10], [1, 2], False), ([0, 9], [1, 12], False)):
        run = subprocess.run([sys.executable, "-c", script.format(ids=ids, target=target)], capture_output=True,
                             text=True, timeout=300, cwd=pathlib.Path(__file__).resolve().parents[2])
        assert (run.returncode == 0 and "done" in run.stdout) == ok, (ids, target, run.stdout, run.stderr[-2000:])
        if not ok:
            assert "device-side assert" in run.stderr, run.stderr[-2000:]


class _Scaled(nn.Embedding):
    """As transformers' Gemma embeddings: the rows times a non-persistent buffer, in its own forward."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed_scale = nn.Buffer(torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class _OwnLookup(nn.Embedding):
    def forward(self, ids):
        return F.embedding(ids, self.weight) * 2.0


class _Biased(_Scaled):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = nn.Parameter(torch.zeros(self.embedding_dim))


def _subclass_parity(rank, ws, sequence_parallel):
    torch.manual_seed(0)
    ref = _Scaled(VOCAB, DIM, padding_idx=30, scale=DIM ** 0.5)  # row 30: rank 1's local row 5 at tp=2
    emb = VocabParallelEmbedding.from_embedding(ref, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))
    out_ref = ref(ids)
    out_ref.pow(2).sum().backward()
    out = emb(ids)  # [SEQ (/ tp under SP), BATCH, DIM]
    out.pow(2).sum().backward()
    if sequence_parallel:
        out = all_gather(out.detach(), 0, dist.group.WORLD)
    grad = gather_full(emb.weight.grad, dist.group.WORLD, emb.weight.tp_shard)[:VOCAB]
    # As an nn.Embedding it is its local table: nn.Embedding's own re-initialisation zeroes the
    # padding row of the rank that holds it, and only that row.
    local_padding_idx = emb.padding_idx
    emb.reset_parameters()
    full = gather_full(emb.weight.detach(), dist.group.WORLD, emb.weight.tp_shard)[:VOCAB]
    return {"class": type(emb).__name__, "is scaled": isinstance(emb, _Scaled),
            "buffers": sorted(emb.state_dict()), "output": _rel(out, out_ref.detach()),
            "grad": _rel(grad, ref.weight.grad), "local padding_idx": local_padding_idx,
            "zero rows after reset": (full.abs().sum(-1) == 0).nonzero().flatten().tolist()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_embedding_subclass_keeps_its_forward(sequence_parallel):
    # Note [nn.Embedding subclasses]: the subclass's scaling runs around the vocabulary-parallel lookup.
    for rank, r in enumerate(run_distributed(_subclass_parity, 2, args=(sequence_parallel,))):
        assert (r["class"], r["is scaled"], r["buffers"]) == ("VocabParallel_Scaled", True, ["weight"]), r
        assert r["output"] < RTOL and r["grad"] < RTOL, (rank, r)
        assert r["local padding_idx"] == [None, 30 - VOCAB // 2][rank] and r["zero rows after reset"] == [30], r


def test_embedding_subclass_refusals():
    from parallel_layers.tensor_parallel import VocabParallel, parallelize

    with pytest.raises(ValueError, match=r"_Biased has its own forward and holds parameters \['bias'\] besides its "
                                         r"weight; keep this embedding replicated"):
        VocabParallelEmbedding.from_embedding(_Biased(VOCAB, DIM, scale=2.0))
    model = nn.ModuleDict({"fc": nn.Linear(DIM, DIM), "emb": _Biased(VOCAB, DIM, scale=2.0)})
    with pytest.raises(ValueError, match=r"parallelize: emb: VocabParallelEmbedding: _Biased has its own forward"):
        parallelize(model, {"fc": "column", "emb": VocabParallel()})
    assert type(model["fc"]) is nn.Linear  # refused before anything was converted
    own = VocabParallelEmbedding.from_embedding(_OwnLookup(VOCAB, DIM))
    with pytest.raises(RuntimeError, match=r"_OwnLookup.forward does not call nn.Embedding.forward"):
        own(torch.tensor([0, 1]))


def test_a_rank_whose_rows_are_all_padding_holds_an_empty_piece():
    # a vocabulary of 5 at tp=4: rows of 2, rank 3's (6-7) all padding. Its piece started past
    # the logical tensor's end and parallelize failed on that rank only (review finding)
    from parallel_layers.placement import box_pieces
    from parallel_layers.tensor_parallel.sharding import sharded_parameter

    held = []
    for rank in range(4):
        p = sharded_parameter(torch.arange(24.0).view(8, 3), 0, 4, rank, logical_rows=5)
        held += [(piece.global_offsets, piece.sizes) for piece in box_pieces(p.tp_shard.layout(5))]
    assert held == [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (1, 3))]  # rank 3: nothing
