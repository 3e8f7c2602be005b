"""Every layout of a cluster (`candidates`), and the rules that pick one and give every other the
reason it lost, with its numbers (`recommend`; docs/parallelism.md, "Composing")."""

from __future__ import annotations

from parallel_layers.plan.cost import estimate
from parallel_layers.plan.model import GB, ModelSpec
from parallel_layers.plan.specs import RECOMPUTE, ClusterSpec, Estimate, Layout, TrainSpec

def _structural_reason(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, dp: int, tp: int, pp: int,
                       zero: int, cp: int = 1, v: int = 1) -> str | None:
    """The hard rules (docs/parallelism.md, "Composing"); None when the layout may run."""
    if tp > cluster.gpus_per_node:
        return f"tp={tp} > gpus_per_node {cluster.gpus_per_node}: TP only within a node"
    if model.n_heads % tp:
        return f"heads {model.n_heads} not divisible by tp={tp}"
    if model.n_kv_heads % tp:
        return f"kv heads {model.n_kv_heads} not divisible by tp={tp} (each rank needs whole key/value heads)"
    if model.ffn_width % tp:
        return f"ffn {model.ffn_width} not divisible by tp={tp}"
    if not model.tied and model.vocab % tp:  # a tied head stays replicated; the embedding pads its rows
        return (f"vocab {model.vocab} not divisible by tp={tp} (the untied head is column-parallel over the "
                "vocabulary, and parallelize refuses a split that leaves rows over)")
    if train.lora_rank and model.experts and tp > 1:  # Note [LoRA in the plan]
        return (f"tp={tp} with LoRA on a mixture of experts: peft adapts the stacked expert weights (its "
                "ParamWrapper), which tensor parallelism does not split (parallelize refuses it)")
    if model.layers < pp * v:  # PipelineStages cuts unevenly (balanced), but every stage needs a layer
        return f"layers {model.layers} < pp={pp} x v={v} stages: every pipeline stage needs at least one layer"
    if model.seq % (2 * cp) and cp > 1:
        return f"seq {model.seq} not divisible by 2 * cp={cp} (causal load balance gives each rank two chunks)"
    if train.global_batch % dp:
        return f"global batch {train.global_batch} not divisible by dp={dp}"
    if pp > 1 and zero > 1:
        return f"ZeRO-{zero} with pp={pp}: with PP keep ZeRO at stage 1 (stages 2/3 add a collective per microbatch)"
    if train.global_batch // dp < pp:
        return (f"only {train.global_batch // dp} sequences per replica (global batch {train.global_batch} / dp={dp}) "
                f"< pp={pp}: needs microbatches >= stages")
    if train.micro_batch and (train.global_batch // dp) % train.micro_batch:
        return (f"global batch {train.global_batch} / dp={dp} = {train.global_batch // dp} sequences per replica, "
                f"not a multiple of micro_batch {train.micro_batch}")
    return None


def runs_sequence_parallel(train: TrainSpec, tp: int) -> bool:
    """Whether parallelize splits the sequence at a layout of this tp: at every one with tp > 1,
    pipelines and microbatches included (Note [sequence parallelism across stages] in
    pipeline/hf.py)."""
    return train.sequence_parallel and tp > 1


def _microbatch_choices(per_replica: int, pp: int, micro_batch: int | None = None) -> list[int]:
    """Microbatch counts to try: for pp > 1 those >= 4p (fewest first), then fewer down to p;
    for pp = 1 the fewest (no accumulation) first. `_best_of_layout` takes the fastest that fits
    among the first group, ties to fewer (larger microbatches: GEMM efficiency, not modelled)."""
    if micro_batch:
        return [per_replica // micro_batch] if per_replica // micro_batch >= pp else []
    divs = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and m >= pp]
    return [m for m in divs if m >= 4 * pp] + [m for m in reversed(divs) if m < 4 * pp] if pp > 1 else divs


def _memory_options(train: TrainSpec, zero: int) -> list[tuple[str, bool]]:
    """(recompute, offload) pairs in the order they cost time: none; selective (with eager
    attention, a few percent more compute); full (a third more); then the same with the
    optimizer in host memory (a PCIe round trip and a host Adam per step)."""
    rcs = (list(RECOMPUTE) if train.recompute == "auto" else
           sorted(train.recompute, key=RECOMPUTE.index) if isinstance(train.recompute, tuple) else [train.recompute])
    if train.flash_attention and "selective" in rcs and len(rcs) > 1:
        rcs.remove("selective")  # flash attention already recomputes the scores: selective == none
    offloads = [train.optimizer_offload] if train.optimizer_offload is not None else [False, True]
    return [(rc, off) for off in offloads if not (off and zero == 0) for rc in rcs]


def _memory_reason(e: Estimate, cluster: ClusterSpec) -> str:
    return (f"needs {e.memory / GB:.1f} GB per GPU > {cluster.gpu_mem_bytes / GB:.0f} GB (params "
            f"{e.params / GB:.1f} + optimizer {e.optimizer / GB:.1f} + the larger of activations {e.activations / GB:.1f} "
            f"+ loss temporaries {e.loss_temporaries / GB:.1f} + grads meanwhile {e.grads_at_loss / GB:.1f} and grads "
            f"{e.grads / GB:.1f}, at microbatch {e.micro_batch}, recompute {e.layout.recompute}"
            f"{', optimizer offloaded' if e.layout.offload else ''})")


def _fits(e: Estimate, cluster: ClusterSpec) -> bool:
    return (e.memory <= cluster.gpu_mem_bytes
            and e.host * min(cluster.gpus, cluster.gpus_per_node) <= cluster.host_mem_bytes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> list[Estimate]:
    """Every dp * tp * pp * cp = gpus layout with each ZeRO stage (ZeRO only with dp * cp > 1)
    and virtual stage count, estimated at its best microbatch count, recomputation and offload;
    those that break a rule or do not fit carry a reason."""
    if train.expert_parallel and not model.experts:
        raise ValueError(f"expert parallelism spreads a mixture of experts' experts over dp; {model.name or 'this model'} "
                         "is dense (no experts): leave expert_parallel unset (--expert-parallel auto)")
    out = []
    n = cluster.gpus
    cps = [train.context_parallel] if train.context_parallel else [c for c in _divisors(n) if c == 1 or c % 2 == 0]
    fixed = {"context_parallel": train.context_parallel, "tensor_parallel": train.tensor_parallel,
             "pipeline_parallel": train.pipeline_parallel}
    product = 1
    for value in fixed.values():
        product *= value or 1
    if n % product:
        raise ValueError(f"the fixed degrees {', '.join(f'{k}={v}' for k, v in fixed.items() if v)} multiply to "
                         f"{product}, which does not divide gpus {n}")
    for cp in cps:
        for tp in _divisors(n // cp) if not train.tensor_parallel else [train.tensor_parallel]:
            for pp in _divisors(n // (cp * tp)) if not train.pipeline_parallel else [train.pipeline_parallel]:
                if n % (cp * tp * pp):
                    continue  # a fixed degree that this cp x tp leaves no room for
                dp = n // (tp * pp * cp)
                vs = [train.virtual_stages] if train.virtual_stages else [1, 2, 4]
                for v in (vs if pp > 1 else [1]):
                    zeros = [train.zero] if train.zero is not None else list(range(4))
                    if train.optimizer_offload and dp * cp > 1:
                        zeros = [z for z in zeros if z >= 1]  # offload is a ZeRO feature
                    eps = _expert_parallel_choices(model, train, dp, cp)
                    for zero in zeros if dp * cp > 1 else (0,):
                        for ep in eps:
                            out.append(_best_of_layout(model, cluster, train, dp, tp, pp, zero, cp, v, ep))
    return out


def _expert_parallel_choices(model: ModelSpec, train: TrainSpec, dp: int, cp: int) -> list[int]:
    """The ep degrees to estimate at dp: a mixture of experts also with its experts over every
    ep > 1 dividing dp and the expert count (cp = 1); with expert_parallel set, only with (ep =
    dp for True; a degree that does not divide them gets a reason) or only without, where it
    applies."""
    asked = train.expert_parallel
    if not model.experts or dp == 1 or cp > 1 or asked is False or (train.lora_rank and asked is None):
        return [1]
    if asked is True:
        return [dp]
    if asked is not None:
        return [asked]
    return [1] + [ep for ep in _divisors(dp) if ep > 1 and model.experts % ep == 0]


def _best_of_layout(model, cluster, train, dp, tp, pp, zero, cp, v, ep=1) -> Estimate:
    reason = _structural_reason(model, cluster, train, dp, tp, pp, zero, cp, v)
    if reason is None and dp % ep:
        reason = f"dp={dp} not divisible by ep={ep} (expert parallelism spreads the experts over groups of ep dp ranks)"
    elif reason is None and ep > 1 and train.lora_rank:  # Note [LoRA in the plan]
        reason = (f"ep={ep} with LoRA: peft's adapters of the stacked expert weights cover every expert, and expert "
                  "parallelism keeps some per rank (parallelize refuses it)")
    elif reason is None and model.experts % ep:
        over = f"dp={dp} (expert parallelism spreads them over dp)" if ep == dp else f"ep={ep}"
        reason = f"experts {model.experts} not divisible by {over}"
    if reason is not None:
        shown = ep if dp % ep == 0 else 1
        e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, max(1, pp), cp, v, ep=shown))
        e.reason = reason
        return e
    ms = _microbatch_choices(train.global_batch // dp, pp, train.micro_batch)
    options = _memory_options(train, zero)
    if not ms or not options:
        e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, max(1, pp), cp, v, ep=ep))
        e.reason = (f"only {train.global_batch // (dp * train.micro_batch)} microbatches of {train.micro_batch} "
                    f"sequences per replica < pp={pp}: needs microbatches >= stages" if not ms else
                    f"optimizer offload needs ZeRO >= 1 (it moves the optimizer shard), and dp={dp} x cp={cp} runs "
                    "without ZeRO")
        return e
    smallest = None
    wide = [m for m in ms if pp == 1 or m >= 4 * pp]
    for rc, off in options:  # the cheapest option that fits; at it, the fastest microbatch count
        for group in (wide, [m for m in ms if m not in wide]):  # m >= 4p before m < 4p
            fit = []
            for m in group:
                e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, m, cp, v, rc, off, ep))
                if _fits(e, cluster):
                    fit.append(e)
                elif smallest is None or e.memory < smallest.memory:
                    smallest = e
            if fit:  # ties (pp = 1: accumulation costs nothing here) go to fewer, larger microbatches
                return min(fit, key=lambda e: (round(e.step_time, 3), e.layout.microbatches))
    smallest.reason = _memory_reason(smallest, cluster)
    if smallest.host * min(cluster.gpus, cluster.gpus_per_node) > cluster.host_mem_bytes:
        smallest.reason += f"; host memory {smallest.host / GB:.0f} GB per GPU exceeds the node's"
    return smallest


# Pure data parallelism (no TP, PP or CP) wins when it fits without recomputation or offload and
# its step is within this fraction of the fastest layout: it is the simplest to run (no plan, no
# stage cut) and the estimates are not finer than this.
DP_ONLY_SLACK = 0.10
# Estimates closer than this are ties at the model's resolution. A tie goes to ZeRO 0-1 over
# 2-3 (their per-microbatch collectives cost latency the bandwidth model does not see), then,
# among layouts using over half the GPU's memory, to the most headroom (the model leaves out
# allocator fragmentation and temporary buffers, so headroom is what keeps an estimate safe),
# then to less traffic and the simpler layout.
TIE = 0.05


def _tightness(e: Estimate, cluster: ClusterSpec) -> int:
    """GB used beyond half the GPU (0 below it): the tie-break's measure of too little headroom."""
    return round(e.memory / GB) if e.memory > cluster.gpu_mem_bytes / 2 else 0


def recommend(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec = TrainSpec()
              ) -> tuple[Estimate | None, list[Estimate]]:
    """(the recommended layout or None when nothing fits, every other layout with its reason).

    Rules (docs/parallelism.md), after the hard ones in `candidates`: when a layout without
    TP, PP or CP fits without recomputation or offload (and is within DP_ONLY_SLACK of the
    fastest), the model is trained with DDP or ZeRO alone; otherwise TP and PP split it, and
    ZeRO-2/3 are not run across nodes (PP takes the slow links) unless nothing else fits.
    Among those, the fastest estimated step wins, a tie (within TIE) going to the most memory
    headroom; with PP, m >= 4p microbatches are preferred.
    """
    all_ = candidates(model, cluster, train)
    ok = [e for e in all_ if e.reason is None]
    fastest = min((e.step_time for e in ok), default=0.0)
    pure_dp = [e for e in ok if e.layout.tp == e.layout.pp == e.layout.cp == 1 and e.layout.recompute == "none"
               and not e.layout.offload and e.step_time <= (1 + DP_ONLY_SLACK) * fastest]
    if pure_dp:
        dp_best = min(pure_dp, key=lambda e: e.step_time)
        for e in ok:
            if e.layout.tp > 1 or e.layout.pp > 1 or e.layout.cp > 1:
                e.reason = (f"the model fits without TP/PP ({dp_best.layout} needs {dp_best.memory / GB:.1f} GB "
                            "per GPU): DDP/ZeRO only, TP and PP would add communication and bubble")
        ok = [e for e in ok if e.reason is None]
    else:
        # Model parallelism is needed. Across nodes, ZeRO-2/3's per-microbatch traffic would
        # ride the slow links; there PP carries the split and ZeRO stays at stage 1 (section 5).
        low = [e for e in ok if e.layout.zero <= 1]
        for e in ok:
            lay = e.layout
            if low and lay.zero >= 2 and lay.tp * lay.cp * lay.dp > cluster.gpus_per_node:
                e.reason = (f"ZeRO-{lay.zero} over dp={lay.dp} spanning nodes moves {e.comm['dp'] / GB:.0f} GB per "
                            f"step over {cluster.inter_node_bw / GB:.0f} GB/s links (per microbatch); the model needs "
                            "model parallelism, so PP takes the slow links with ZeRO-1")
        ok = [e for e in ok if e.reason is None]
    wide = [e for e in ok if e.layout.pp == 1 or e.layout.microbatches >= 4 * e.layout.pp]
    if wide:  # m < 4p only when no layout reaches it
        for e in ok:
            if e.layout.pp > 1 and e.layout.microbatches < 4 * e.layout.pp:
                e.reason = (f"m={e.layout.microbatches} < 4 * pp={e.layout.pp} (bubble {100 * e.bubble:.0f}%) "
                            "while other layouts reach m >= 4p")
        ok = wide
    # Ties on time (DP traffic hidden under backward) go to less traffic, then the simpler
    # layout: the lower ZeRO stage, no interleaving, no recomputation, no offload. Time and
    # traffic tie within 0.1% of the fastest step and of the most traffic: 1 ms and 1 MB had
    # been the grain, which made every layout of a small model tie, so that candidate order
    # chose (a 2x slower DDP over pp2; review finding, helper-71).
    most_traffic = max((sum(e.comm.values()) for e in ok), default=0.0) or 1.0
    key = lambda e: (round(e.step_time / (fastest or 1.0), 3),  # noqa: E731
                     round(sum(e.comm.values()) / most_traffic, 3), e.layout.zero,
                     e.layout.virtual, RECOMPUTE.index(e.layout.recompute), e.layout.offload)
    best = min(ok, key=key) if ok else None
    if best is not None and not pure_dp:  # ties between model-parallel layouts (see TIE)
        near = [e for e in ok if e.step_time <= (1 + TIE) * best.step_time]
        best = min(near, key=lambda e: (e.layout.zero >= 2, _tightness(e, cluster), key(e)))
    for e in ok:
        if e is best:
            continue
        if e.step_time > (1 + TIE) * best.step_time:
            e.reason = (f"slower: est. step {e.step_time:.3g} s vs {best.step_time:.3g} s for {best.layout} "
                        f"(bubble {100 * e.bubble:.0f}%, comm {sum(e.comm.values()) / GB:.1f} GB/step)")
        elif e.layout.zero >= 2 > best.layout.zero:
            e.reason = (f"same est. step (within {TIE:.0%}): {e.step_time:.3g} s vs {best.step_time:.3g} s for "
                        f"{best.layout}, with ZeRO-{e.layout.zero} vs {best.layout.zero}: the lower stage wins")
        elif _tightness(e, cluster) > _tightness(best, cluster):
            e.reason = (f"same est. step (within {TIE:.0%}): {e.step_time:.3g} s vs {best.step_time:.3g} s for "
                        f"{best.layout}, which leaves more memory headroom ({best.memory / GB:.0f} vs "
                        f"{e.memory / GB:.0f} GB per GPU; the model omits fragmentation and temporary buffers)")
        else:
            e.reason = (f"same est. step (within {TIE:.0%}): {e.step_time:.3g} s vs {best.step_time:.3g} s for "
                        f"{best.layout}, with {sum(e.comm.values()) / GB:.3g} vs {sum(best.comm.values()) / GB:.3g} "
                        f"GB/step of communication and ZeRO-{e.layout.zero} vs {best.layout.zero}: the faster step, "
                        "then less traffic and the simpler layout win")
    for e in all_:
        if e is not best and e.reason is None:  # unreachable guard: every loser must say why
            raise AssertionError(f"{e.layout} was neither recommended nor given a reason")
    # the closest first: within a rule by step time; out of memory by the memory needed (when
    # nothing fits, the least-memory layout is the one to read first)
    rejected = sorted((e for e in all_ if e is not best),
                      key=lambda e: (_rank_of(e.reason), e.memory if reason_kind(e.reason) == "out of memory"
                                     else e.step_time))
    return best, rejected


def launch_args(e: Estimate, train: TrainSpec) -> dict:
    """How to run a layout with this library: `init_parallel`'s and `parallelize`'s keyword
    arguments (what a `--verify` run of the top candidates passes), and under "unsupported" what
    of the layout parallel_layers cannot run yet (then the layout cannot be verified here)."""
    import torch

    lay = e.layout
    unsupported = [f"context parallel cp={lay.cp}"] if lay.cp > 1 else []
    # Note [mixed precision in the plan] in cost.py: what "mixed" is in this library
    mixed, lora = train.precision == "mixed", train.lora_rank is not None
    return {
        # the dtype to build and load the model in
        "model_dtype": torch.bfloat16 if mixed and lora else torch.float32,
        "init_parallel": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
        # pipeline_layers: "auto" cuts a Hugging Face decoder (a model of your own: its layer list's attribute)
        "parallelize": {"zero_stage": lay.zero, "microbatches": lay.microbatches,
                        "pipeline_layers": "auto" if lay.pp > 1 or lay.microbatches > 1 else None,
                        "schedule": "interleaved" if lay.virtual > 1 else "1f1b",
                        "virtual": lay.virtual if lay.virtual > 1 else None,
                        "activation_checkpointing": None if lay.recompute == "none" else lay.recompute,
                        "sequence_parallel": runs_sequence_parallel(train, lay.tp),
                        "offload_optimizer": lay.offload,
                        "expert_parallel": False if lay.ep == 1 else True if lay.ep == lay.dp else lay.ep,
                        "fused_kernels": train.fused_kernels,
                        "param_dtype": torch.bfloat16 if mixed and not lora and lay.zero >= 1 else None},
        "micro_batch": e.micro_batch,
        "unsupported": unsupported,
    }


# (leading words of a reason, the rule it names): the order of the rejected list, closest first.
_KINDS = (("same est. step", "tie"), ("slower", "slower"), ("m=", "m < 4p"), ("the model fits", "fits without TP/PP"),
          ("needs", "out of memory"), ("tp=", "TP across nodes"), ("heads", "heads % tp"),
          ("kv heads", "kv heads % tp"), ("ffn", "ffn % tp"), ("vocab", "vocab % tp"), ("layers", "layers < stages"), ("seq", "seq % 2cp"),
          ("global batch", "batch % dp"), ("ZeRO-", "ZeRO > 1 with PP or across nodes"),
          ("only", "microbatches < stages"), ("optimizer offload", "offload without ZeRO"),
          ("experts", "experts % dp"))


def reason_kind(reason: str) -> str:
    """The rule a reason comes from, for grouping the rejected list."""
    return next((label for prefix, label in _KINDS if reason.startswith(prefix)), "other")


def _rank_of(reason: str) -> int:
    labels = [label for _, label in _KINDS]
    kind = reason_kind(reason)
    return labels.index(kind) if kind in labels else len(labels)


