"""Layout planner: which (dp, tp, pp, ZeRO stage, microbatches) to train a GPT with.

    python -m parallel_layers.plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 \\
        --gpus 64 --gpus-per-node 8 --gpu-mem 80GB

    best, rejected = recommend(ModelSpec(7e9, 32, 4096, 4096), ClusterSpec(64, 8, parse_size("80GB")))

Every layout with dp * tp * pp = gpus is estimated (per-rank memory, communication per step,
pipeline bubble, step time), the rules of docs/parallelism.md ("Composing") pick one, and every other
layout carries the reason it lost, with its numbers.

Memory per rank, the model (bytes per parameter of this rank's share, Ψ = params / (tp * pp)
with LayerNorms and row biases replicated over tp, N = dp):
  precision "mixed" (ZeRO paper): 2 param + 2 grad + 12 optimizer (fp32 master, Adam m, v);
  precision "fp32": 4 param + 4 grad + 8 optimizer (Adam m, v; the param is the master).
  ZeRO 0 = DataParallel: all of it, plus one more gradient-sized buffer when dp > 1 (our
           DataParallel packs gradients into bucket buffers of their own, not views of .grad).
  ZeRO 1: optimizer / N. ZeRO 2: also grads / N, plus one layer's full grads (reduced per layer).
  ZeRO 3: also params / N, plus two layers' full params (the gathered one and the prefetched one).
Activations, per layer and token, for a pre-LayerNorm GPT block like examples/train_gpt.py
(fused QKV, attention, out-projection, ffn-wide GeLU MLP; Megatron's activation paper's
accounting, e bytes per element, a heads, t = tp, sequence parallel divides the rest by t too):
  outside the TP region: 4h elements (both LayerNorms' inputs and outputs), 2h bytes of
      dropout masks when dropout is on, 16 bytes of LayerNorm statistics (fp32 mean, rstd);
  inside it (/ t): 4h + 2 * ffn elements (QKV, attention output, GeLU input and output);
  attention scores (/ t): eager: a * s * (2e + 1 with dropout) bytes (probabilities, mask,
      dropped); flash: 4a bytes (fp32 log-sum-exp).
  With e = 2, dropout, eager and ffn = 4h this is Megatron's s*b*h*(34 + 5*a*s/h) (tp = 1).
  The last stage adds the head: final LayerNorm input and output (2h elements) and the
  cross-entropy's fp32 softmax over its vocab / t slice (4 * vocab / t bytes).
  1F1B: stage 0 holds p microbatches of activations, the last stage one. Token ids, targets
  and other integer tensors (~20 bytes per token) are not counted.
Communication per rank per step (ring collectives: all-reduce moves 2(n-1)/n of the buffer,
all-gather and reduce-scatter (n-1)/n): dp gradients (ZeRO 0: one all-reduce; 1: reduce-
scatter + all-gather of params; 2: a reduce-scatter per microbatch + the all-gather; 3: per
microbatch two all-gathers and a reduce-scatter); tp: four
activation all-reduces per layer and two for the vocab-parallel embedding and head, per
microbatch; pp: one activation forward and one gradient backward per microbatch.
Step time = compute * (m + p - 1) / m + tp and pp communication + the part of dp
communication that compute does not hide (backward, 2/3 of it; stage 3: all of it); compute = (6 * params + 12 *
layers * hidden * seq) flops per token at `mfu` of the peak. An axis runs at intra-node
bandwidth when its group fits on one node (mesh order pp, dp, tp: tp innermost).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

GB = 1e9
_PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes per parameter: param, grad, optimizer


def parse_size(text: str | float | int) -> float:
    """'80GB', '80 GiB', '512MB', '7e9', '7B' (a count), 1e9 -> a number (bytes or a count)."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise ValueError(f"cannot parse size {text!r}: expected a number with an optional unit, one of "
                         f"{sorted(u for u in units if u)} (e.g. '80GB', '7e9', '7B')")
    return float(m.group(1)) * units[m.group(2)]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A GPT: total parameters (tied embedding included), layers, hidden size, sequence length."""

    params: float
    layers: int
    hidden: int
    seq: int
    heads: int | None = None  # default hidden / 128
    vocab: int = 32000
    ffn: int | None = None  # MLP width, default 4 * hidden

    def __post_init__(self):
        for name in ("params", "layers", "hidden", "seq", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)!r}")
        if self.params <= self.vocab * self.hidden:
            raise ValueError(f"params {self.params:.3g} <= the embedding alone (vocab {self.vocab} * hidden "
                             f"{self.hidden} = {self.vocab * self.hidden:.3g}); check --params and --vocab")

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def layer_params(self) -> float:
        """Parameters of one layer: everything but the (tied) embedding, spread over the layers."""
        return (self.params - self.vocab * self.hidden) / self.layers


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    gpu_mem_bytes: float
    flops: float = 989e12  # per GPU, dense bf16 (H100 SXM)
    intra_node_bw: float = 450e9  # bytes/s per GPU (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per GPU (400 Gb/s InfiniBand)
    mfu: float = 0.5  # fraction of `flops` the GEMMs reach: an assumption, not a measurement

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % min(self.gpus, self.gpus_per_node):
            raise ValueError(f"gpus ({self.gpus}) must be a positive multiple of gpus_per_node "
                             f"({self.gpus_per_node}) or fewer than it")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    global_batch: int = 512  # sequences per optimizer step
    precision: str = "mixed"  # "mixed" (bf16 params/grads/activations, fp32 Adam) or "fp32"
    dropout: bool = True
    flash_attention: bool = False  # False: eager attention keeps the s x s scores (Megatron's formula)
    sequence_parallel: bool = True

    def __post_init__(self):
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {list(_PRECISIONS)}, got {self.precision!r}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int  # 0 = DataParallel
    microbatches: int  # per step and data-parallel replica (gradient accumulation when pp = 1)

    def __str__(self) -> str:
        z = f"ZeRO-{self.zero}" if self.zero else ("DDP" if self.dp > 1 else "-")
        return f"dp={self.dp} tp={self.tp} pp={self.pp} {z} m={self.microbatches}"


@dataclasses.dataclass
class Estimate:
    layout: Layout
    micro_batch: int  # sequences per microbatch
    params: float  # bytes per rank, worst stage
    grads: float
    optimizer: float
    activations: float
    comm: dict[str, float]  # bytes per rank per step, by axis
    bubble: float  # fraction of step time
    step_time: float  # seconds
    reason: str | None = None  # why it was rejected; None for the recommendation

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


# ---- estimates ----------------------------------------------------------------------------
def _stage_params(model: ModelSpec, tp: int, pp: int) -> tuple[float, float]:
    """(params on the largest stage per tp rank, params of one layer per tp rank)."""
    replicated = 6 * model.hidden  # two LayerNorms (weight, bias) and two row-parallel biases
    layer = (model.layer_params - replicated) / tp + replicated
    embedding = model.vocab * model.hidden / tp  # vocab-parallel; the first and last stages hold it
    return model.layers // pp * layer + embedding, max(layer, embedding)


def activation_bytes(model: ModelSpec, train: TrainSpec, tp: int, tokens: float, layers: int,
                     head: bool) -> float:
    """Bytes saved for backward by `layers` layers (and the head) over `tokens` tokens."""
    e, h, a, s = train.act_bytes, model.hidden, model.n_heads, model.seq
    outside_tp = tp if train.sequence_parallel else 1
    per_token = (e * 4 * h + (2 * h if train.dropout else 0)) / outside_tp + 16
    per_token += e * (4 * h + 2 * model.ffn_width) / tp
    per_token += (a * s * (2 * e + (1 if train.dropout else 0)) if not train.flash_attention else 4 * a) / tp
    total = tokens * layers * per_token
    if head:
        total += tokens * (e * 2 * h / outside_tp + 4 * model.vocab / tp)
    return total


def estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout) -> Estimate:
    """Per-rank memory, communication, bubble and step time of one layout (no rule checks)."""
    dp, tp, pp, zero, m = layout.dp, layout.tp, layout.pp, layout.zero, layout.microbatches
    pb, gb, ob = _PRECISIONS[train.precision]
    psi, layer = _stage_params(model, tp, pp)
    params, grads, opt = psi * pb, psi * gb, psi * ob
    if zero == 0 and dp > 1:
        grads += psi * gb  # DataParallel's bucket buffers
    if zero >= 1:
        opt /= dp
    if zero >= 2:
        grads = psi * gb / dp + layer * gb
    if zero == 3:
        params = psi * pb / dp + 2 * layer * pb
    micro_batch = max(1, train.global_batch // (dp * m))
    tokens = micro_batch * model.seq
    first = activation_bytes(model, train, tp, tokens * pp, model.layers // pp, head=pp == 1)
    last = activation_bytes(model, train, tp, tokens, model.layers // pp, head=True)
    acts = max(first, last)

    ring = lambda n: (n - 1) / n  # noqa: E731  (fraction of a buffer each rank sends in a ring pass)
    # Stages 0 and 1 accumulate full gradients locally over the microbatches and reduce once;
    # stage 2 keeps only a gradient shard, so it reduce-scatters every microbatch, and stage 3
    # also gathers the params for every microbatch's forward and backward.
    if zero == 0:
        dp_bytes = 2 * ring(dp) * psi * gb
    elif zero == 1:
        dp_bytes = ring(dp) * psi * (gb + pb)
    elif zero == 2:
        dp_bytes = ring(dp) * psi * (m * gb + pb)
    else:
        dp_bytes = ring(dp) * psi * m * (gb + 2 * pb)
    act = tokens * model.hidden * train.act_bytes  # one [s, b, h] activation
    tp_bytes = 2 * ring(tp) * act * (4 * model.layers // pp + 2) * m
    pp_bytes = 2 * act * m if pp > 1 else 0.0
    comm = {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_bytes}

    def bandwidth(inner: int) -> float:
        return cluster.intra_node_bw if inner <= cluster.gpus_per_node else cluster.inter_node_bw
    flops = (6 * model.params + 12 * model.layers * model.hidden * model.seq) * train.global_batch * model.seq
    compute = flops / (cluster.gpus * cluster.flops * cluster.mfu)
    bubble = (pp - 1) / (m + pp - 1)
    overlap = 1.0 if zero == 3 else 2 / 3  # dp traffic overlaps backward; stage 3's gathers forward too
    step = (compute / (1 - bubble) + tp_bytes / bandwidth(tp) + pp_bytes / bandwidth(tp * dp * pp)
            + max(0.0, dp_bytes / bandwidth(tp * dp) - overlap * compute))
    return Estimate(layout, micro_batch, params, grads, opt, acts, comm, bubble, step)


# ---- candidates and rules -----------------------------------------------------------------
def _structural_reason(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, dp: int, tp: int, pp: int,
                       zero: int) -> str | None:
    """The hard rules (docs/parallelism.md, "Composing"); None when the layout may run."""
    if tp > cluster.gpus_per_node:
        return f"tp={tp} > gpus_per_node {cluster.gpus_per_node}: TP only within a node"
    if model.n_heads % tp:
        return f"heads {model.n_heads} not divisible by tp={tp}"
    if model.layers % pp:
        return f"layers {model.layers} not divisible by pp={pp}"
    if train.global_batch % dp:
        return f"global batch {train.global_batch} not divisible by dp={dp}"
    if pp > 1 and zero > 1:
        return f"ZeRO-{zero} with pp={pp}: with PP keep ZeRO at stage 1 (stages 2/3 add a collective per microbatch)"
    if train.global_batch // dp < pp:
        return (f"only {train.global_batch // dp} sequences per replica (global batch {train.global_batch} / dp={dp}) "
                f"< pp={pp}: needs microbatches >= stages")
    return None


def _microbatch_choices(per_replica: int, pp: int) -> list[int]:
    """Microbatch counts to try, best first: for pp > 1 the fewest >= 4p (big microbatches,
    small bubble), then fewer down to p; for pp = 1 the fewest (no accumulation) first."""
    divs = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and m >= pp]
    return [m for m in divs if m >= 4 * pp] + [m for m in reversed(divs) if m < 4 * pp] if pp > 1 else divs


def _memory_reason(e: Estimate, cluster: ClusterSpec) -> str:
    return (f"needs {e.memory / GB:.1f} GB per GPU > {cluster.gpu_mem_bytes / GB:.0f} GB (params "
            f"{e.params / GB:.1f} + grads {e.grads / GB:.1f} + optimizer {e.optimizer / GB:.1f} + activations "
            f"{e.activations / GB:.1f} at microbatch {e.micro_batch})")


def candidates(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> list[Estimate]:
    """Every dp * tp * pp = gpus layout with each ZeRO stage (ZeRO only with dp > 1), estimated
    at its best microbatch count; those that break a rule or do not fit carry a reason."""
    out = []
    n = cluster.gpus
    for tp in (d for d in range(1, n + 1) if n % d == 0):
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0):
            dp = n // (tp * pp)
            for zero in range(4) if dp > 1 else (0,):
                reason = _structural_reason(model, cluster, train, dp, tp, pp, zero)
                if reason is not None:
                    e = estimate(model, cluster, train, Layout(dp, tp, pp, zero, max(1, pp)))
                    e.reason = reason
                    out.append(e)
                    continue
                tried = [estimate(model, cluster, train, Layout(dp, tp, pp, zero, m))
                         for m in _microbatch_choices(train.global_batch // dp, pp)]
                fits = [e for e in tried if e.memory <= cluster.gpu_mem_bytes]
                e = fits[0] if fits else min(tried, key=lambda e: e.memory)
                if not fits:
                    e.reason = _memory_reason(e, cluster)
                out.append(e)
    return out


def recommend(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec = TrainSpec()
              ) -> tuple[Estimate | None, list[Estimate]]:
    """(the recommended layout or None when nothing fits, every other layout with its reason).

    Rules (docs/parallelism.md), after the hard ones in `candidates`: when a layout without
    TP or PP fits, the model is trained with DDP or ZeRO alone; otherwise TP and PP split it,
    and ZeRO-2/3 are not run across nodes (PP takes the slow links) unless nothing else fits.
    Among those, the fastest estimated step wins; with PP, m >= 4p microbatches are preferred.
    """
    all_ = candidates(model, cluster, train)
    ok = [e for e in all_ if e.reason is None]
    pure_dp = [e for e in ok if e.layout.tp == 1 and e.layout.pp == 1]
    if pure_dp:
        dp_best = min(pure_dp, key=lambda e: e.step_time)
        for e in ok:
            if e.layout.tp > 1 or e.layout.pp > 1:
                e.reason = (f"the model fits without TP/PP ({dp_best.layout} needs {dp_best.memory / GB:.1f} GB "
                            "per GPU): DDP/ZeRO only, TP and PP would add communication and bubble")
        ok = pure_dp
    else:
        # Model parallelism is needed. Across nodes, ZeRO-2/3's per-microbatch traffic would
        # ride the slow links; there PP carries the split and ZeRO stays at stage 1 (section 5).
        low = [e for e in ok if e.layout.zero <= 1]
        for e in ok:
            lay = e.layout
            if low and lay.zero >= 2 and lay.tp * lay.dp > cluster.gpus_per_node:
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
    # Ties on time (DP traffic hidden under backward) go to less traffic, then the lower stage.
    key = lambda e: (round(e.step_time, 3), sum(e.comm.values()), e.layout.zero)  # noqa: E731
    best = min(ok, key=key) if ok else None
    for e in ok:
        if e is best:
            continue
        if round(e.step_time, 3) > round(best.step_time, 3):
            e.reason = (f"slower: est. step {e.step_time:.2f} s vs {best.step_time:.2f} s for {best.layout} "
                        f"(bubble {100 * e.bubble:.0f}%, comm {sum(e.comm.values()) / GB:.1f} GB/step)")
        else:
            e.reason = (f"same est. step {e.step_time:.2f} s as {best.layout}, with {sum(e.comm.values()) / GB:.1f} "
                        f"vs {sum(best.comm.values()) / GB:.1f} GB/step of communication and ZeRO-{e.layout.zero} vs "
                        f"{best.layout.zero}: the lower stage and less traffic win")
    for e in all_:
        if e is not best and e.reason is None:  # unreachable guard: every loser must say why
            raise AssertionError(f"{e.layout} was neither recommended nor given a reason")
    rejected = sorted((e for e in all_ if e is not best), key=lambda e: (_rank_of(e.reason), e.step_time))
    return best, rejected


# (leading words of a reason, the rule it names): the order of the rejected list, closest first.
_KINDS = (("same est. step", "tie"), ("slower", "slower"), ("m=", "m < 4p"), ("the model fits", "fits without TP/PP"),
          ("needs", "out of memory"), ("tp=", "TP across nodes"), ("heads", "heads % tp"), ("layers", "layers % pp"),
          ("global batch", "batch % dp"), ("ZeRO-", "ZeRO > 1 with PP or across nodes"),
          ("only", "microbatches < stages"))


def reason_kind(reason: str) -> str:
    """The rule a reason comes from, for grouping the rejected list."""
    return next((label for prefix, label in _KINDS if reason.startswith(prefix)), "other")


def _rank_of(reason: str) -> int:
    labels = [label for _, label in _KINDS]
    kind = reason_kind(reason)
    return labels.index(kind) if kind in labels else len(labels)


# ---- CLI ----------------------------------------------------------------------------------
def _row(e: Estimate, mark: str) -> str:
    return (f"{mark:1s} {str(e.layout):34s} {e.params / GB:6.1f} {e.grads / GB:6.1f} {e.optimizer / GB:6.1f} "
            f"{e.activations / GB:6.1f} {e.memory / GB:7.1f} {sum(e.comm.values()) / GB:8.2f} "
            f"{100 * e.bubble:6.1f} {e.step_time:8.2f}")


def format_plan(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, best: Estimate | None,
                rejected: list[Estimate], rows: int = 15, contenders: int = 5, per_kind: int = 2) -> str:
    lines = [f"model: {model.params / 1e9:.2f}B params, {model.layers} layers, hidden {model.hidden}, "
             f"{model.n_heads} heads, ffn {model.ffn_width}, vocab {model.vocab}, seq {model.seq}",
             f"cluster: {cluster.gpus} GPUs ({cluster.gpus_per_node}/node, {cluster.gpu_mem_bytes / GB:.0f} GB, "
             f"{cluster.flops / 1e12:.0f} TFLOP/s at {cluster.mfu:.0%}, {cluster.intra_node_bw / GB:.0f}/"
             f"{cluster.inter_node_bw / GB:.0f} GB/s intra/inter-node)",
             f"training: global batch {train.global_batch} sequences, {train.precision} precision Adam, "
             f"{'flash' if train.flash_attention else 'eager'} attention, dropout {'on' if train.dropout else 'off'}, "
             f"sequence parallel {'on' if train.sequence_parallel else 'off'}", "",
             f"  {'layout':34s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'activ':>6s} {'total':>7s} "
             f"{'comm':>8s} {'bubble':>6s} {'step':>8s}",
             f"  {'':34s} {'GB':>6s} {'GB':>6s} {'GB':>6s} {'GB':>6s} {'GB':>7s} {'GB/step':>8s} {'%':>6s} "
             f"{'s (est)':>8s}"]
    shown = ([best] if best else []) + rejected[:rows - 1]
    lines += [_row(e, "*" if e is best else "") for e in shown]
    lines.append("")
    lines.append(f"recommended: {best.layout}, microbatch {best.micro_batch} sequences" if best
                 else "nothing fits: more GPUs, a smaller batch per microbatch, or activation recomputation")
    lines.append(f"rejected ({len(rejected)} layouts): the {contenders} closest, then each rule's first examples")
    lines += [f"  {str(e.layout):34s} {e.reason}" for e in rejected[:contenders]]
    rest = rejected[contenders:]
    for kind in dict.fromkeys(reason_kind(e.reason) for e in rest):
        group = [e for e in rest if reason_kind(e.reason) == kind]
        lines.append(f"  ... {len(group)} more rejected ({kind}), e.g.")
        lines += [f"    {str(e.layout):32s} {e.reason}" for e in group[:per_kind]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", required=True, help="parameter count, e.g. 7e9 or 7B")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--heads", type=int, default=None, help="default hidden / 128")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=None, help="MLP width, default 4 * hidden")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--gpu-mem", required=True, help="e.g. 80GB")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak per GPU")
    ap.add_argument("--mfu", type=float, default=0.5, help="fraction of peak reached")
    ap.add_argument("--intra-node-bw", default="450GB", help="per GPU, per second")
    ap.add_argument("--inter-node-bw", default="50GB", help="per GPU, per second")
    ap.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    ap.add_argument("--precision", choices=list(_PRECISIONS), default="mixed")
    ap.add_argument("--flash-attention", action="store_true", help="do not store the s x s attention scores")
    ap.add_argument("--no-dropout", action="store_true")
    ap.add_argument("--no-sequence-parallel", action="store_true")
    ap.add_argument("--rows", type=int, default=15, help="table rows to print")
    args = ap.parse_args(argv)
    try:
        model = ModelSpec(parse_size(args.params), args.layers, args.hidden, args.seq, args.heads, args.vocab,
                          args.ffn)
        cluster = ClusterSpec(args.gpus, args.gpus_per_node, parse_size(args.gpu_mem), args.tflops * 1e12,
                              parse_size(args.intra_node_bw), parse_size(args.inter_node_bw), args.mfu)
        train = TrainSpec(args.global_batch, args.precision, not args.no_dropout, args.flash_attention,
                          not args.no_sequence_parallel)
    except ValueError as err:
        ap.error(str(err))
    best, rejected = recommend(model, cluster, train)
    print(format_plan(model, cluster, train, best, rejected, rows=args.rows))


if __name__ == "__main__":
    main()
