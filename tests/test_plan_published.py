"""The planner against layouts that large training runs published (docs/planner.md, "Validation").

For each run: its model, cluster and batch as published, the training system's options as it had
them (Megatron-LM in 2021: no ZeRO, no selective recomputation, no sequence parallelism; DeepSpeed's
pipeline: no interleaving; metaseq: no pipeline), then
- recommend() lands within 2x of the published TP, PP and DP (and CP) degrees;
- the published layout itself fits in the memory model (a layout that ran must not be
  estimated over the GPU's memory) and its estimated step is within 30% of ours;
- where the run published its recomputation, ours is the same or the comment says why not.
Estimated TFLOP/s per GPU are printed in docs/planner.md beside the published ones (with
`mfu` = 0.5 an assumption, they are not a prediction of the measured numbers).
"""

import dataclasses

import pytest

from parallel_layers.plan import ClusterSpec, ModelSpec, TrainSpec, candidates, recommend

A100 = lambda gpus, **kw: ClusterSpec.preset("a100-80gb", gpus, 8, **kw)  # noqa: E731
H100 = lambda gpus: ClusterSpec.preset("h100", gpus, 8)  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Run:
    source: str
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    tp: int
    pp: int
    dp: int
    cp: int = 1
    recompute: str | None = None  # as published; None: not published
    xfail: str | None = None  # a known miss: why ours differs (docs/planner.md)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", Table 1 (GPT, vocab 51,200, seq 2048, Selene: DGX A100 80 GB nodes). Columns:
# params (B), heads, hidden, layers, TP, PP, GPUs, batch. Its FLOP count (the paper's appendix)
# includes the extra forward of activation recomputation: every run recomputed in full.
MEGATRON_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512), (3.6, 32, 3072, 30, 2, 1, 64, 512), (7.5, 32, 4096, 36, 4, 1, 128, 512),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024), (39.1, 64, 8192, 48, 8, 2, 512, 1536),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792), (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160), (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]
# The 2021 system: no distributed optimizer, recomputation full or none, no sequence parallel, eager attention.
_MEGATRON_TRAIN = dict(flash_attention=False, sequence_parallel=False, zero=0, recompute=("none", "full"))
_2022_TRAIN = dict(flash_attention=False, sequence_parallel=False, recompute=("none", "full"))


def _llama3(seq):  # Llama 3 405B (Dubey et al. 2024, Table 3): 126 layers, 16384 hidden, 128 heads, 8 kv heads
    return ModelSpec(None, 126, 16384, seq, heads=128, vocab=128256, ffn=53248, kv_heads=8, mlp="swiglu",
                     tied=False, dropout=False)


RUNS = {
    **{f"Megatron-LM 2021 GPT {p}B": Run("Narayanan et al. 2021, Table 1",
                                          ModelSpec(None, layers, h, 2048, heads=a, vocab=51200), A100(gpus),
                                          TrainSpec(batch, **_MEGATRON_TRAIN), tp, pp, gpus // (tp * pp),
                                          recompute="full")
       for p, a, h, layers, tp, pp, gpus, batch in MEGATRON_2021},
    # Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", section 2.4: 992 A100
    # 80 GB, Fully Sharded Data Parallel with Megatron-LM tensor parallelism (TP 8), no pipeline;
    # 96 layers, 96 heads, hidden 12288, seq 2048, batch 2M tokens (992 sequences of 2048 = 2.03M).
    "OPT-175B": Run("Zhang et al. 2022, OPT, sections 2.2 and 2.4",
                    ModelSpec(None, 96, 12288, 2048, heads=96, vocab=50272), A100(992),
                    TrainSpec(992, pipeline_parallel=1, **_2022_TRAIN), 8, 1, 124),
    # BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", section
    # 3.4: 384 A100 80 GB in 48 nodes, TP 4 x PP 12 x DP 8 with ZeRO stage 1 (Megatron-DeepSpeed),
    # 70 layers, hidden 14336, 112 heads, seq 2048, batch 2048; each node reaches the others through
    # 4 x 100 Gb/s Omni-Path links (50 GB/s a node, 6.25 GB/s a GPU).
    "BLOOM-176B": Run("BigScience 2022, BLOOM, sections 3.3-3.4",
                      ModelSpec(None, 70, 14336, 2048, heads=112, vocab=250880), A100(384, inter_node_bw=50e9 / 8),
                      TrainSpec(2048, virtual_stages=1, **_2022_TRAIN), 4, 12, 8),
    # Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section 2:
    # 4480 A100 80 GB (560 DGX A100), TP 8 x PP 35 x DP 16, 105 layers, hidden 20480, 128 heads,
    # seq 2048, batch 1920 (after warm-up); DeepSpeed's 1F1B pipeline (no interleaving).
    "MT-NLG 530B": Run("Smith et al. 2022, MT-NLG, sections 2-3",
                       ModelSpec(None, 105, 20480, 2048, heads=128, vocab=51200), A100(4480),
                       TrainSpec(1920, virtual_stages=1, **_2022_TRAIN), 8, 35, 16),
    # Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: H100 80 GB, 16M tokens a batch;
    # TP 8, CP 1, PP 16 at seq 8192 on 8192 and 16384 GPUs, and TP 8, CP 16, PP 16 at seq 131072.
    "Llama 3 405B, 8K, 8192 GPUs": Run("Dubey et al. 2024, Table 4", _llama3(8192), H100(8192),
                                       TrainSpec(2048, flash_attention=True), 8, 16, 64),
    "Llama 3 405B, 8K, 16384 GPUs": Run("Dubey et al. 2024, Table 4", _llama3(8192), H100(16384),
                                        TrainSpec(2048, flash_attention=True), 8, 16, 128),
    "Llama 3 405B, 128K, CP": Run(
        "Dubey et al. 2024, Table 4", _llama3(131072), H100(16384),
        TrainSpec(128, flash_attention=True, context_parallel=None), 8, 16, 8, cp=16,
        xfail="the CP cost is bandwidth only: with 8 kv heads K and V are 1/16 of the hidden size, so the model "
              "sees a cp=64-128 all-gather as cheap and prefers it to pipeline stages (the published layout "
              "is estimated ~40% slower than ours); it has no term for the attention kernel's efficiency on "
              "1-2K-token local chunks or for the ring's per-step latency"),
}


def _within_2x(ours: int, published: int) -> bool:
    return max(ours, published) / min(ours, published) <= 2


def _published_estimates(run: Run):
    return [e for e in candidates(run.model, run.cluster, run.train)
            if (e.layout.tp, e.layout.pp, e.layout.dp, e.layout.cp) == (run.tp, run.pp, run.dp, run.cp)]


@pytest.mark.parametrize("name", list(RUNS))
def test_recommendation_is_within_2x_of_the_published_layout(name, request):
    run = RUNS[name]
    if run.xfail:
        request.applymarker(pytest.mark.xfail(reason=run.xfail, strict=True))
    best, _ = recommend(run.model, run.cluster, run.train)
    assert best is not None, f"{name}: nothing fits"
    lay = best.layout
    axes = {"tp": (lay.tp, run.tp), "pp": (lay.pp, run.pp), "dp": (lay.dp, run.dp), "cp": (lay.cp, run.cp)}
    off = {axis: v for axis, v in axes.items() if not _within_2x(*v)}
    assert not off, f"{name} ({run.source}): ours {lay} vs published tp={run.tp} pp={run.pp} dp={run.dp} cp={run.cp}"


@pytest.mark.parametrize("name", list(RUNS))
def test_the_published_layout_fits_and_is_close(name, request):
    """A layout that ran must fit the memory model (at some ZeRO stage, recomputation and
    microbatch count the system had), and our model must not call it far slower than ours."""
    run = RUNS[name]
    if run.xfail:
        request.applymarker(pytest.mark.xfail(reason=run.xfail, strict=True))
    fitting = [e for e in _published_estimates(run) if e.reason is None]
    assert fitting, f"{name}: the published layout does not fit: {[e.reason for e in _published_estimates(run)]}"
    best, _ = recommend(run.model, run.cluster, run.train)
    published = min(e.step_time for e in fitting)
    assert published <= 1.3 * best.step_time, (
        f"{name}: published layout est. {published:.1f} s/step vs ours {best.step_time:.1f} s ({best.layout})")


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run.recompute])
def test_recomputation_where_published(name):
    """Megatron-LM 2021 recomputed every layer in every run. Ours recomputes only where the
    activations fit no other way (the largest models). Elsewhere either the published layout
    fits without recomputation in our model too (recomputing was the system's default: its
    FLOP count includes it), or ours reaches a layout that needs none (e.g. a deeper pipeline
    for 145.6B) whose estimated step beats the published layout's with recomputation."""
    run = RUNS[name]
    best, _ = recommend(run.model, run.cluster, run.train)
    if best.layout.recompute == run.recompute:
        return
    assert (best.layout.recompute, run.recompute) == ("none", "full"), name
    no_recompute = dataclasses.replace(run.train, recompute="none")
    published_fits_without = [e for e in candidates(run.model, run.cluster, no_recompute)
                              if (e.layout.tp, e.layout.pp, e.layout.dp) == (run.tp, run.pp, run.dp)
                              and e.reason is None]
    published_full = min(e.step_time for e in _published_estimates(run) if e.reason is None)
    assert published_fits_without or best.step_time < published_full, (
        f"{name}: ours skips recomputation ({best.layout}, {best.step_time:.1f} s), yet the published layout needs "
        f"it in our model and is estimated faster ({published_full:.1f} s)")
