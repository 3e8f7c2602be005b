"""The cost model: per-rank memory, communication, bubble and step time of one layout (`estimate`).

Memory per rank, the model (bytes per parameter of this rank's share, Ψ = the largest pipeline
stage's params / tp, with norms and row biases replicated over tp, N = dp * cp):
  precision "mixed" (ZeRO paper): 2 param + 2 grad + 12 optimizer (fp32 master, Adam m, v);
  precision "fp32": 4 param + 4 grad + 8 optimizer (Adam m, v; the param is the master).
  ZeRO 0 = DataParallel: all of it, plus one more gradient-sized buffer when dp > 1 (our
           DataParallel packs gradients into bucket buffers of their own, not views of .grad).
  ZeRO 1: optimizer / N. ZeRO 2: also grads / N, plus one layer's full grads (reduced per layer)
           and the root group's (reduced last: a tied embedding, a position table, the final norm).
  ZeRO 3: also params / N, plus two units' full params (the gathered one and the prefetched one;
           a unit is a layer, or the embedding or head when untied) and the root's, whole all step;
           on the CPU also the buffer pool's idle gather buffers, a layer's params each
           (TrainSpec.pooled_gather_buffers, set by --verify).
  Optimizer offload (ZeRO >= 1): the optimizer shard lives in host memory instead.
  The peak (Note [peak memory]): params + optimizer + the larger of (activations + the loss's
  temporaries + the gradients that exist by the loss: DataParallel's buckets, and with m > 1
  the accumulated ones plus the largest layer's being added) and all the gradients.
Activations, per layer and token (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models": s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit with dropout and eager
attention; e bytes per element, a heads, q = heads * head_dim, k = kv_heads * head_dim, f the MLP
width, t = tp, sequence parallel divides the part outside the TP region by t too):
  outside the TP region: 4h elements (both norms' inputs and outputs; with sequence parallel
      and LoRA the outputs whole, peft's lora_A keeps the gathered input: Note [sequence
      parallelism's gathered inputs in the plan]), 2h bytes of
      dropout masks when dropout is on (2h elements on the CPU, whose dropout keeps its mask in
      the input's dtype: TrainSpec.dropout_mask_bytes, set by --verify), 16 bytes of norm
      statistics (fp32);
  inside it (/ t): q + 2k (Q, K, V; eager attention keeps K and V repeated to the q heads,
      transformers' repeat_kv: 2q) + q (attention output) + the MLP's: GeLU 2f (its input and
      output), SwiGLU 3f (parallelize's fused `linear_swiglu`: the packed [gate; up] and their
      product; 4f unfused - TrainSpec.fused_kernels=False, and a mixture's experts: gate, up,
      silu(gate), the product, as Hugging Face's eager LlamaMLP keeps);
  attention scores (/ t): eager: a * s * (2e + 1) bytes with dropout (probabilities, mask,
      dropped; 3e on the CPU), a * s * e without (the probabilities), 4 bytes more in 16-bit
      where the softmax is taken in float32 and kept (transformers' eager attention:
      TrainSpec.float32_softmax, set for --hf-config); flash: 4a bytes (fp32 log-sum-exp).
  Recomputation: "selective" drops the scores term (recomputed in backward: the 5as/h of the
  formula; nothing changes with flash attention, which recomputes them already); "full" keeps
  only each layer's input, e*h per token (/ t with sequence parallel), plus one layer's full
  activations while it is recomputed.
  The last stage adds the head: final norm input and output (2h elements; h / t + h with
  sequence parallel, the output gathered) and the
  cross-entropy's fp32 softmax over its vocab / t slice (4 * vocab / t bytes; the whole vocab
  when the head's output is gathered, TrainSpec.vocab_parallel_loss=False), and for a moment two
  more such fp32 copies (the logits and the loss's input in forward; two gradients in backward).
  1F1B: stage 0 holds p microbatches of activations, the last stage one; interleaved (v virtual
  stages) stage 0 holds (1 + (p - 1) / (p v)) times that. Context parallel splits each sequence's
  tokens over cp ranks (the scores still span the whole sequence).
Communication per rank per step (ring collectives: all-reduce moves 2(n-1)/n of the buffer,
all-gather and reduce-scatter (n-1)/n): dp gradients (ZeRO 0: one all-reduce; 1: reduce-
scatter + all-gather of params; 2: a reduce-scatter per microbatch + the all-gather; 3: per
microbatch two all-gathers and a reduce-scatter); tp: four activation all-reduces per layer (or
the same bytes as all-gathers and reduce-scatters with sequence parallel; six with full
recomputation) and two for the vocab-parallel embedding and head, per microbatch; cp: K and V
all-gathered in forward and again in backward plus their gradients reduce-scattered, per layer
and microbatch; pp: one activation forward and one gradient backward per microbatch and virtual stage.
Step time = compute / (1 - bubble) + tp, cp and pp communication + the part of dp communication
that compute does not hide (ZeRO-3: all of compute; ZeRO-2: backward, 2/3 of it; stages 0 and 1:
the last microbatch's backward, none after a pipeline's flush) + the offloaded optimizer
step (PCIe both ways and the host's Adam); compute = model flops (6 per matmul parameter per
token + 12 * layers * seq * q for attention, plus the recomputed forward) at `mfu` of the peak.
An axis runs at intra-node bandwidth when its group fits on one node (mesh order pp, dp, cp, tp:
tp innermost), at inter-node bandwidth otherwise.

Note [mixed precision in the plan]: precision "mixed" is, in this library, `parallelize(...,
param_dtype=torch.bfloat16)` over a float32 model at ZeRO 1-3 (`launch_args` passes it; Note
[mixed precision by the parameters] in parallelize.py): the full parameters gathered (ZeRO-3) or
kept (ZeRO-1/2) in bfloat16, float32 masters and Adam state sharded - the ZeRO paper's 2 + 12 bytes
a parameter. Two of its gradient terms are float32, not the paper's 2 bytes: the gradient shards
ZeRO reduces into (4 / N bytes a parameter: the reduce dtype), and, with several backward passes
a step (m > 1: a pipeline's or gradient accumulation's microbatches), the gradients accumulated
over them (4 bytes a parameter from the second pass on: Note [accumulating in the reduce dtype]
in zero/_param.py; FSDP2 and Megatron's main_grad hold the same). So ZeRO-2 holds 2 + 16 / N
bytes a parameter where the paper has 2 + 14 / N. ZeRO-3 holds the paper's 16 / N, split
otherwise: the shard a rank holds is the float32 master itself (params 4 / N, grads 4 / N, Adam's
moments 8 / N, where the paper has 2 / N, 2 / N and 12 / N): with no gradient alive at the loss,
the split matters to the peak (the paper's put a tiny Llama's at 0.87 of --verify's measure). A LoRA
fine-tune's mixed precision is a bfloat16 model (`launch_args`' model_dtype) with peft's float32
adapters: nothing of the base trains, and the adapters are float32 anyway. At ZeRO-0 this
library's DataParallel holds no float32 masters (param_dtype needs ZeRO): the estimate is the
paper's (other systems' DDP with masters, e.g. Megatron-LM's), which `--verify` skips.

Note [LoRA in the plan]: with TrainSpec.lora_rank = r only the adapters train (A [r, in] and
B [out, r] on each of a layer's linear layers: q, k, v, o and a dense MLP's; under TP a column
layer's B split and A whole, a row layer's A split and B whole, as tensor_parallel/lora.py cuts
them), so gradients, optimizer state and the data-parallel gradient traffic are the adapters'
(`trained`), in float32 (peft keeps a 16-bit model's adapters so: 4 + 4 + 8 bytes a parameter
with AdamW). The base model is frozen: its parameters at `pb` bytes (the model's dtype: a
frozen parameter's ZeRO shard keeps it, Note [frozen shards keep their dtype] in
zero/_param.py), whole at ZeRO-0/1/2 (a ZeRO-1/2 shard is a view of it) and sharded at ZeRO-3,
whose units are still gathered for every forward and backward; nothing of it is reduced or
gathered after the step. Backward computes the frozen matrices' input gradients only: 4 flops
per parameter and token where training all of them takes 6 (the adapters 6). The head stays
frozen. The activations are those without adapters but for these terms (--verify measured a
Llama 1.03-1.22 of the estimate without them, helper-79; tests/test_plan_hf.py counts a layer's
saved tensors): each adapter acting on tokens keeps its lora_A output, r float32 elements a
token (in float32, the input it keeps is the base layer's own: lora_dropout=0 is an Identity);
a 16-bit model's adapter casts its input to the adapters' float32 for lora_A (peft's
_cast_input_dtype), which keeps that copy: 4 bytes an input feature a token, per adapter (q, k
and v each their own), where the 16-bit input is then kept by nothing (a frozen layer's backward
needs its weight, not its input: the norms' outputs, the attention's and the MLP's products);
and a dense SwiGLU MLP whose projections are adapted runs unfused (fuse
leaves peft's layers alone), keeping 4 ffn-wide tensors a token, not linear_swiglu's 3. Not
subtracted: the frozen embedding's output needs no gradient, so the first layer keeps about 2h
elements a token less (measured on a whole 2-layer model; a few % of one layer).
A mixture of experts is adapted as peft 0.21's "all-linear" adapts transformers 5's (session
39, counted against peft): its router, an nn.Linear, as the other linear layers, and its
stacked expert weights through peft's ParamWrapper: per expert, gate_up_proj at rank 2r
(peft's rank pattern for the packed pair) and down_proj at rank r. ParamWrapper runs no adapter
per token: each forward adds every expert's low-rank product to the whole expert weight (one
batched GEMM) and the tokens go through that merged weight, which autograd keeps for backward
(measured: one layer's expert weights more saved per layer and microbatch) and whose weight
gradient backward computes (6 flops per active expert parameter and token, not 4; one layer's
merged weight and its gradient at a time besides). So ZeRO-3 gathers and frees the frozen
experts but each layer's merged copy stays until its backward; the merge's own GEMMs (about a
hundredth of a layer's flops at 4096 tokens) are not counted. Tensor and expert parallelism
do not split those adapters: parallelize refuses both (a structural reason here).
"""

from __future__ import annotations

from parallel_layers.plan.model import ModelSpec
from parallel_layers.plan.specs import _PRECISIONS, _REDUCE_BYTES, ClusterSpec, Estimate, Layout, TrainSpec

_REPLICATED = 6  # per layer, in units of hidden: two norms (weight, bias) and two row-parallel biases


def stage_layers(model: ModelSpec, pp: int, v: int = 1) -> int:
    """Layers of the largest pipeline stage: PipelineStages splits unevenly when pp * v does
    not divide the layers (balanced: the largest chunk holds ceil(layers / (pp * v)))."""
    return -(-model.layers // (pp * v)) * v


def _lora_layer_parts(model: ModelSpec, r: int, tp: int = 1) -> tuple[float, float]:
    """(adapters that act on each token, a mixture's expert adapters) of one decoder layer per
    tp rank (Note [LoRA in the plan])."""
    h, q, kv, f = model.hidden, model.q_width, model.kv_width, model.ffn_width
    dense = not model.experts
    columns = [(h, q), (h, kv), (h, kv)] + ([(h, f)] * (2 if model.mlp == "swiglu" else 1) if dense else [])
    rows = [(q, h)] + ([(f, h)] if dense else [])
    per_token = r * (sum(i + o / tp for i, o in columns) + sum(i / tp + o for i, o in rows))
    if dense:
        return per_token, 0.0
    up = 2 * (h + 2 * f) if model.mlp == "swiglu" else h + f  # gate_up_proj at rank 2r; an up_proj at r
    return per_token + r * (h + model.experts), model.experts * r * (up + f + h)


def _lora_token_bytes(model: ModelSpec, train: TrainSpec, tp: int) -> float:
    """Bytes a token that one decoder layer's adapters keep for backward beyond the base layers'
    own (Note [LoRA in the plan]): each nn.Linear adapter (q, k, v, o, a dense MLP's, a
    mixture's router) its float32 lora_A output, r elements, whole on every tp rank
    (tensor_parallel/lora.py); and where the model is 16-bit, the float32 copy of its input that
    peft casts to the adapters' dtype for lora_A (a column layer's input whole, a row layer's
    split over tp)."""
    h, q, f = model.hidden, model.q_width, model.ffn_width
    columns, rows = [h, h, h], [q]  # q, k, v; o
    if model.experts:
        columns.append(h)  # the router
    else:
        columns += [h] * (2 if model.mlp == "swiglu" else 1)
        rows.append(f)
    kept = 4 * train.lora_rank * (len(columns) + len(rows))
    if train.act_bytes != 4:  # the float32 copies, in place of the 16-bit inputs that only frozen
        # layers read (their backward needs the weight, not the input): the norms' outputs (a
        # mixture's experts keep theirs) and the attention's and MLP's products
        outside_tp = tp if train.sequence_parallel else 1
        kept += 4 * (sum(columns) + sum(rows) / tp)
        kept -= train.act_bytes * ((h if model.experts else 2 * h) / outside_tp + sum(rows) / tp)
    return kept


def lora_layer_params(model: ModelSpec, r: int, tp: int = 1) -> float:
    """One decoder layer's LoRA adapter parameters per tp rank (Note [LoRA in the plan]); with
    tp = 1 all of them."""
    return sum(_lora_layer_parts(model, r, tp))


def _merged_experts(model: ModelSpec, train: TrainSpec) -> float:
    """Parameters of one layer's merged expert weights under LoRA (Note [LoRA in the plan]), 0
    without a mixture or LoRA."""
    return model.experts * model.mlp_params if train.lora_rank and model.experts else 0.0


def _decoder_layer_params(model: ModelSpec, tp: int, held_apart: float = 0.0) -> float:
    """One decoder layer's params per tp rank (its norms and row biases replicated), less
    `held_apart` (the experts under expert parallelism)."""
    replicated = _REPLICATED * model.hidden
    return (model.layer_params - replicated) / tp + replicated - held_apart


def _stage_params(model: ModelSpec, tp: int, pp: int, v: int = 1, held_apart: float = 0.0) -> tuple[float, float]:
    """(params on the largest stage per tp rank, params of ZeRO's largest unit per tp rank: a
    layer, or an untied embedding or head; Note [ZeRO-3's units in the plan]), less
    `held_apart` per layer per tp rank (the experts under expert parallelism)."""
    layer = _decoder_layer_params(model, tp, held_apart)
    embedding = model.vocab * model.hidden / tp  # vocab-parallel
    first = embedding + model.positions * model.hidden
    last = 0.0 if model.tied and pp == 1 else embedding  # the head: tied shares the first's unless pp > 1
    ends = first + last if pp == 1 else max(first, last)
    return stage_layers(model, pp, v) * layer + ends, max(layer, 0.0 if model.tied else embedding)


# Note [sequence parallelism's gathered inputs in the plan]: Korthikanti et al.'s sequence
# parallelism keeps 1 / t of everything outside the TP regions, the regions re-gathering their
# input in backward. This library's regions kept the gathered input instead, saved whole by the
# column layers for their weight gradients, and the final norm's gathered output by the head:
# helper-89 measured 2 x [8, 256, 512] float32 gathered inputs and 2 x [8, 128, 512] norm inputs
# per layer at tp=2 on an h512 Llama (saved_tensors_hooks and the profiler's allocations at the
# peak), which put tp=2 at 1.10 of --verify's measure. The column layers now keep their chunk
# and gather it again in backward (Note [re-gathering the sequence in backward] in
# tensor_parallel/layers.py): per layer and token the norms' inputs and outputs are 4h / t, as the
# paper has them. Two still keep a gathered input whole: a Hugging Face head, which reads a slice
# of the final norm's output (logits_to_keep), not the gather's own tensor (h / t + h), and
# peft's lora_A on an adapted column layer, an nn.Linear of its own (2h / t + 2h a layer).
# Note [ZeRO-3's units in the plan]: parallelize's ZeRO-3 gathers a Hugging Face model's units
# one at a time with the next one prefetched: the decoder layers and, untied, the embedding and
# the head each a unit of its own (Note [vocabulary units] in parallelize.py), so two of the
# largest (`layer`, the larger of a layer and the vocabulary matrix) are whole at once. The
# root group - a tied embedding (its weight read by the head too), a learned position table, the
# final norm - stays whole for the whole step on every rank, and so do its gradients until the
# end of backward, where the root is reduce-scattered last.
def _root_params(model: ModelSpec, tp: int) -> float:
    """Parameters per tp rank that ZeRO-3 keeps whole in its root group."""
    return (model.vocab * model.hidden / tp if model.tied else 0.0) + model.positions * model.hidden + model.hidden


def _layer_token_bytes(model: ModelSpec, train: TrainSpec, tp: int, recompute: str) -> float:
    """Bytes one layer keeps for backward per token of this rank (Korthikanti et al. 2022)."""
    e, h, a, s = train.act_bytes, model.hidden, model.n_heads, model.seq
    dropout = model.dropout if train.dropout is None else train.dropout
    outside_tp = tp if train.sequence_parallel else 1
    if recompute == "full":
        return e * h / outside_tp
    m = train.dropout_mask_bytes
    # the norms' inputs and outputs split with sequence parallelism: the regions' column layers
    # keep their chunk and gather it again in backward - but for peft's lora_A, which keeps the
    # gathered input (Note [sequence parallelism's gathered inputs in the plan])
    kept_whole = 2 * h if train.lora_rank and outside_tp > 1 else 0
    per_token = (e * (4 * h - kept_whole) + (2 * h * m if dropout else 0)) / outside_tp + e * kept_whole + 16
    # experts run unfused (tensor_parallel/experts.py), and so does an MLP whose projections peft
    # adapted (fused.py: the LoRA layers keep their own forward; Note [LoRA in the plan])
    swiglu = 3 if train.fused_kernels and not model.experts and not train.lora_rank else 4
    mlp = (model.mlp_kept or (swiglu if model.mlp == "swiglu" else 2)) * model.ffn_width * max(1, model.experts_per_token)
    # eager attention keeps K and V repeated to every query head (transformers' repeat_kv: the
    # copies the score and output matmuls read); flash attention keeps them as they are
    kv = model.q_width if not train.flash_attention and recompute == "none" else model.kv_width
    per_token += e * (2 * model.q_width + 2 * kv + mlp) / tp
    if train.lora_rank:
        per_token += _lora_token_bytes(model, train, tp)
    if train.flash_attention:
        per_token += 4 * a / tp
    elif recompute == "none":
        # transformers' eager attention takes the softmax of 16-bit scores in float32 and keeps
        # that (4 bytes) besides the 16-bit probabilities it casts back (TrainSpec.float32_softmax)
        upcast = 4 if train.float32_softmax and e < 4 else 0
        per_token += a * s * (2 * e + m + upcast if dropout else e + upcast) / tp
    return per_token


def activation_bytes(model: ModelSpec, train: TrainSpec, tp: int, tokens: float, layers: int,
                     head: bool, recompute: str = "none") -> float:
    """Bytes saved for backward by `layers` layers (and the head) over `tokens` tokens."""
    total = tokens * layers * _layer_token_bytes(model, train, tp, recompute)
    if head:
        e, outside_tp = train.act_bytes, tp if train.sequence_parallel else 1
        # the final norm's input split with sequence parallelism, its output gathered for the head
        total += tokens * (e * model.hidden * (1 / outside_tp + 1) + 4 * _loss_vocab(train, model, tp))
    return total


def _loss_vocab(train: TrainSpec, model: ModelSpec, tp: int) -> float:
    """Vocabulary entries per token the loss sees on a rank: its vocab-parallel slice, or all of
    it when the head's output is gathered (transformers' 'colwise_gather_output' lm_head)."""
    return model.vocab / tp if train.vocab_parallel_loss else model.vocab


def loss_temporaries(model: ModelSpec, train: TrainSpec, tp: int, tokens: float) -> float:
    """Float32 [tokens, vocab] copies the loss holds for a moment beyond the log-softmax kept
    for backward: in forward the logits and the cross-entropy's flattened input beside the
    log-softmax; in backward the gradient of the log-softmax and of its input beside it."""
    return 2 * 4 * tokens * _loss_vocab(train, model, tp)


def _token_flops(model: ModelSpec, train: TrainSpec, recompute: str) -> tuple[float, float]:
    """(flops of one layer, of the head) per token in training: 6 per matmul parameter (forward
    2, backward 4), attention's QK^T and AV (12 * seq * q), and the recomputed forward."""
    attention_forward = 4 * model.seq * model.q_width
    # a frozen matrix's backward computes its input's gradient only (Note [LoRA in the plan])
    base = 4 if train.lora_rank else 6
    adapters = _lora_layer_parts(model, train.lora_rank)[0] if train.lora_rank else 0.0
    # a mixture's merged expert weights get their weight gradient too
    merged_grad = 2 * model.experts_per_token * model.mlp_params if _merged_experts(model, train) else 0.0
    layer = base * model.active_layer_params + merged_grad + 6 * adapters + 3 * attention_forward
    if recompute == "full":  # one more forward of the layer (not of the head)
        layer += 2 * (model.active_layer_params + adapters) + attention_forward
    elif recompute == "selective" and not train.flash_attention:  # QK^T, softmax, AV again
        layer += attention_forward
    return layer, base * model.vocab * model.hidden


def _pace(model: ModelSpec, train: TrainSpec, recompute: str, pp: int, v: int) -> float:
    """Flops per token of the busiest pipeline rank. The cut is balanced with the head counted
    (BLOOM's 70 layers + embedding + head filled 12 stages of 6): the last rank's last chunk
    takes k layers and the head, the other pp * v - 1 chunks share the remaining layers evenly
    (ceil); k is the best such split."""
    layer, head = _token_flops(model, train, recompute)
    if pp == 1:
        return model.layers * layer + head
    chunks, best = pp * v, float("inf")
    for k in range(0, -(-model.layers // chunks) + 1):
        rest = -(-(model.layers - k) // (chunks - 1))  # layers of every other chunk
        best = min(best, max(v * rest * layer, (k + (v - 1) * rest) * layer + head))
    return best


def step_flops(model: ModelSpec, train: TrainSpec, recompute: str) -> float:
    """Hardware flops of one step, all GPUs (recomputation included, as Megatron counts them)."""
    layer, head = _token_flops(model, train, recompute)
    return (model.layers * layer + head) * train.global_batch * model.seq


def estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, layout: Layout) -> Estimate:
    """Per-rank memory, communication, bubble and step time of one layout (no rule checks)."""
    dp, tp, pp, zero, m = layout.dp, layout.tp, layout.pp, layout.zero, layout.microbatches
    cp, v, rc = layout.cp, layout.virtual, layout.recompute
    shards = dp * cp  # ZeRO and the gradient reduction span dp x cp (the params are replicated over cp)
    pb, gb, ob = _PRECISIONS[train.precision]
    # Note [experts over dp in the plan]: with layout.ep > 1 each rank holds 1 / ep of the stage's
    # experts (and each of those split over tp), whole: never gathered by ZeRO-3. Over their dp /
    # ep replicas (`replicas`) they are averaged as the rest is over dp, at the end of backward
    # (Note [expert groups] in zero/_hooks.py: their full gradients are all there then, at every
    # stage), and ZeRO shards their optimizer state over them (stage >= 1); with ep = dp they have
    # no replica: params, gradients and optimizer state whole, nothing reduced. Their gradients
    # accumulate whole over microbatches. The rest (`psi`, `layer`) is as without. Per MoE layer
    # and microbatch, two all-to-alls of each token's k hidden vectors in forward and two in
    # backward (and two more in a full recompute), over the ep group.
    ep = layout.ep
    replicas = dp // ep
    expert_layer = model.experts * model.mlp_params / tp if ep > 1 else 0.0
    experts = stage_layers(model, pp, v) * expert_layer / ep
    psi, layer = _stage_params(model, tp, pp, v, held_apart=expert_layer)
    lora = train.lora_rank is not None
    # what trains (Note [LoRA in the plan]): every parameter, or the adapters of the stage's layers
    adapter_layer = lora_layer_params(model, train.lora_rank, tp) if lora else 0.0
    trained, trained_layer = (stage_layers(model, pp, v) * adapter_layer, adapter_layer) if lora else (psi, layer)
    # bytes a trained parameter: the precision's, or (LoRA) float32's - peft keeps the adapters of a
    # 16-bit model in float32 (its autocast_adapter_dtype) and ZeRO's master of one aliases it
    tpb, tgb, tob = _PRECISIONS["fp32"] if lora else (pb, gb, ob)
    params, grads, opt = (psi * pb if lora else 0.0) + trained * tpb, trained * tgb, trained * tob
    if zero == 0 and shards > 1:
        grads += trained * tgb  # DataParallel's bucket buffers
    if zero >= 1:
        opt /= shards
    # Note [mixed precision in the plan]: mixed precision's gradient shards are float32, and so
    # are its gradients accumulated over several backward passes
    mixed = train.precision == "mixed" and not lora and zero >= 1
    shard_gb, accumulated_gb = (_REDUCE_BYTES, _REDUCE_BYTES if m > 1 else gb) if mixed else (tgb, tgb)
    if zero >= 1 and m > 1:
        grads = trained * accumulated_gb
    if zero >= 2 and m == 1:  # the shards, the layer whose gradients are being made, and the one
        # before it being reduce-scattered meanwhile (Note [overlapped reduce-scatter]: float32)
        grads = (trained * shard_gb / shards + trained_layer * tgb
                 + (trained_layer * _REDUCE_BYTES if shards > 1 else 0.0))
        if not lora:  # the root's, whole until it is reduced, last (a LoRA run's root is frozen)
            grads += _root_params(model, tp) * gb * (1 - 1 / shards)
    elif zero >= 2:  # with microbatches (a PipelineParallel step, under no_sync()): the full
        # gradients accumulate as at stage 1 and are reduce-scattered once, after the last one
        grads = trained * accumulated_gb + (trained_layer * _REDUCE_BYTES if shards > 1 else 0.0)
    if zero == 3:  # the shards, two units gathered (Note [ZeRO-3's units in the plan]) and the root whole
        kept = _root_params(model, tp)
        params = (psi - kept) * pb / shards + kept * pb + 2 * layer * pb
        if mixed:  # the shard is the float32 master, which the optimizer's 12 bytes counted
            params += (psi - kept) * (_REDUCE_BYTES - pb) / shards
            opt -= (psi - kept) * _REDUCE_BYTES / shards
        if lora:  # the adapters, members of their layers' units: sharded, and gathered with them
            params += trained * tpb / shards + 2 * trained_layer * tpb
        if stage_layers(model, pp, v) >= 3:  # the pool serves the blocks that three or more groups repeat
            params += train.pooled_gather_buffers * _decoder_layer_params(model, tp, expert_layer) * pb
    expert_grads = 0.0 if lora else experts * gb * (2 if zero == 0 and replicas > 1 else 1)  # DataParallel: + buckets
    if zero >= 2 and replicas > 1 and not lora:  # reduced at the end of backward, a layer's float32 buffer in flight
        expert_grads += expert_layer / ep * _REDUCE_BYTES
    params, grads = params + experts * pb, grads + expert_grads
    opt += 0.0 if lora else experts * ob / (replicas if zero >= 1 else 1)
    host = 0.0
    if layout.offload:
        host, opt = opt, 0.0
    micro_batch = max(1, train.global_batch // (dp * m))
    tokens = micro_batch * model.seq / cp  # this rank's tokens of one microbatch
    n_layers = stage_layers(model, pp, v)
    in_flight = pp * (1 + (pp - 1) / (pp * v) if v > 1 else 1)  # stage 0's microbatches (Korthikanti 4.2.3)
    first = activation_bytes(model, train, tp, tokens * in_flight, n_layers, head=pp == 1, recompute=rc)
    last = activation_bytes(model, train, tp, tokens, n_layers, head=True, recompute=rc)
    merged = _merged_experts(model, train) * pb  # Note [LoRA in the plan]: kept per layer and microbatch
    if merged:  # and one layer's gradient of it in backward
        first += merged * (1 if rc == "full" else n_layers * in_flight) + merged
        last += merged * (1 if rc == "full" else n_layers) + merged
    acts = max(first, last)
    if rc == "full":  # the layer being recomputed holds its activations until its backward is done
        acts += tokens * _layer_token_bytes(model, train, tp, "none")
    # Note [peak memory]: the states of the ZeRO paper (params, grads, optimizer) never all peak
    # with the activations. Gradients are made in backward as the activations are freed, so a
    # rank peaks either at the loss (all activations kept, the loss's logits copies, and what
    # gradients exist by then: DataParallel's buckets, and with m > 1 those accumulated from the
    # earlier microbatches) or at the end of backward (every gradient); params and optimizer
    # state are there throughout (from the second step on).
    # Only the last stage computes the loss: its copies count where they raise the larger stage.
    temporaries = max(first, last + loss_temporaries(model, train, tp, tokens)) - max(first, last)
    # With m > 1 a microbatch's gradient of a parameter is made in a buffer of its own and then
    # added to the accumulated one: the largest layer's (often the head's) is in flight too.
    # (mixed precision: a float32 bank from the second backward pass on, Note [mixed precision in the plan])
    at_loss_gb = accumulated_gb if m > 2 else tgb
    accumulated = trained * at_loss_gb + trained_layer * tgb + (0.0 if lora else experts * gb) if m > 1 else 0.0
    at_loss = (trained * tgb if zero == 0 and shards > 1 else 0.0) + accumulated

    ring = lambda n: (n - 1) / n  # noqa: E731  (fraction of a buffer each rank sends in a ring pass)
    # Every stage reduces the gradients once a step: with microbatches PipelineParallel runs
    # them all under no_sync() and reduces after the last (stages 2 and 3 included); stages 1-2
    # gather the updated params after the step, stage 3 for every microbatch's forward and
    # backward instead.
    # (with LoRA only the adapters are reduced and, at ZeRO-1/2, gathered back; ZeRO-3 still
    # gathers the frozen base for every forward and backward)
    if zero == 0:
        dp_bytes = 2 * ring(shards) * trained * tgb
    elif zero in (1, 2):
        dp_bytes = ring(shards) * trained * (tgb + tpb)
    else:
        dp_bytes = ring(shards) * (trained * tgb + ((psi * pb + trained * tpb) if lora else psi * pb) * 2 * m)
    # the experts over their replicas, once a step: all-reduced (DDP) or reduce-scattered and
    # gathered after the step (ZeRO, at every stage as its stage 1); frozen under LoRA
    dp_bytes += 0.0 if lora else ring(replicas) * experts * (2 * gb if zero == 0 else gb + pb)
    act = tokens * model.hidden * train.act_bytes  # one [s, b, h] activation of this rank
    per_layer = 6 if rc == "full" else 4  # full recomputation repeats the forward's two all-reduces
    tp_bytes = 2 * ring(tp) * act * (per_layer * n_layers + 2) * m
    kv = tokens * cp * model.kv_width / tp * train.act_bytes  # the whole sequence's K and V, this tp shard
    cp_bytes = 3 * ring(cp) * kv * n_layers * m * (2 if rc == "full" else 1) if cp > 1 else 0.0
    pp_bytes = 2 * act * m * v if pp > 1 else 0.0
    ep_bytes = ((6 if rc == "full" else 4) * ring(ep) * act * model.experts_per_token * n_layers * m
                if ep > 1 else 0.0)  # each all-to-all sends (ep - 1) / ep of k rows a token
    comm = {"dp": dp_bytes, "tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "ep": ep_bytes}

    def bandwidth(span: int) -> float:
        return cluster.intra_node_bw if span <= cluster.gpus_per_node else cluster.inter_node_bw
    flops = step_flops(model, train, rc)
    # A pipeline runs at its slowest stage's pace (with pp = 1: the whole model).
    tokens_per_replica = train.global_batch * model.seq / dp
    compute = (_pace(model, train, rc, pp, v) * tokens_per_replica / (tp * cp * cluster.flops * cluster.mfu))
    idle = (pp - 1) / v  # microbatch slots the pipeline idles (interleaving divides them by v)
    bubble = idle / (m + idle)
    # What the dp traffic can hide under: ZeRO-3 gathers in forward and backward (all of it);
    # ZeRO-2 reduce-scatters during backward (2/3 of compute); stages 0 and 1 reduce once, in the
    # last microbatch's backward (pp = 1), or after the pipeline's flush (pp > 1: PipelineParallel
    # reduces once after the last microbatch, as Megatron-LM did). (An approximation: with
    # microbatches PipelineParallel reduces every stage after the last one, and ZeRO-1 at the
    # step, so less hides than this says; the step time is the estimate's least exact part.)
    overlap = {3: 1.0, 2: 2 / 3}.get(zero, 2 / 3 / m if pp == 1 else 0.0)
    offload_time = 0.0
    if layout.offload:  # gradient shard down, updated param shard up, Adam on the host
        offload_time = trained / shards * (tgb + tpb) / cluster.pcie_bw + trained / shards / cluster.cpu_adam_params_per_s
    step = (compute / (1 - bubble) + tp_bytes / bandwidth(tp) + cp_bytes / bandwidth(tp * cp)
            + pp_bytes / bandwidth(cluster.gpus) + max(0.0, dp_bytes / bandwidth(tp * cp * dp) - overlap * compute)
            + ep_bytes / bandwidth(tp * ep) + offload_time)
    e = Estimate(layout, micro_batch, params, grads, opt, acts, comm, bubble, step, flops=flops, host=host,
                 loss_temporaries=temporaries, grads_at_loss=at_loss)
    if cp > 1:
        e.modelled_only = "context parallel is modelled only: parallel_layers does not implement it yet"
    return e


