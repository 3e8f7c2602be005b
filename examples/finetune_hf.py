"""Fine-tune a Hugging Face causal LM (a `save_pretrained` directory) at any layout, check it
against plain transformers in one process, checkpoint it, export it and reload the export.

    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --tp 2 --dp 2 --zero 3
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --pp 2 --tp 2 --activation-checkpointing full
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --pp 2 --tp 2 --sequence-parallel --lora 8
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --model-dir my-llama/ --tp 2
    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py --model-dir my-mixtral/ --zero 3 --expert-parallel
    torchrun --standalone --nproc-per-node 8 examples/finetune_hf.py --model-dir my-mixtral/ --zero 2 --expert-parallel 4
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --dp 2 --zero 3 --param-dtype bfloat16
    torchrun --standalone --nproc-per-node 1 examples/finetune_hf.py            # the reference

Without --model-dir, rank 0 makes a small Llama from a config (grouped-query attention, SwiGLU,
untied head; nothing is downloaded) and saves it with `save_pretrained`: that directory is the
"pretrained" model. Every rank loads it with `from_pretrained` and hands it to
`parallel_layers.parallelize` with no plan of its own (tp_plan="auto": the plan the model
publishes), activation checkpointing of the decoder layers (--activation-checkpointing),
pipeline stages cut at the model's own modules (--pp: embedding -> decoder layers -> norm +
head), ZeRO (--zero 1-3) or DataParallel (--zero 0) over dp, ZeRO's groups being the decoder
layers (the model's `_no_split_modules`, parallelize's default), and for a mixture of experts
(--model-dir of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE) its experts spread over dp
(--expert-parallel) or over groups of EP dp ranks (--expert-parallel EP). With --lora R the model is
adapted by peft first (LoRA of rank R on every linear layer of the decoder, the base frozen): at
any layout, its LoRA layers split with their base layers under tensor parallelism, and the export
is the adapter (peft's adapter_model.safetensors), reloaded on the base model with
`PeftModel.from_pretrained`. The loss is Hugging Face's causal-LM loss on generated sequences (each counts up from a
random token with a random stride, so there is something to learn; a fixed seed per step), each
dp rank taking its rows of the global batch.

At the end: `checkpoint.save` (a DCP checkpoint named like the plain model's state_dict),
`hf.save_pretrained` (a directory plain transformers loads; the source's tokenizer, if it has
one, is saved beside it), then rank 0 trains the plain
transformers model from the same directory on the same global batches in one process and
prints PASS if
(1) the losses agree at every step (the training is the reference's), and
(2) the exported directory, loaded with `AutoModelForCausalLM.from_pretrained`, gives the
    trained parallel model's own logits on a batch no step trained on (the export is the trained
    model). Those logits come from the parallel model's forward at its layout - the pipeline's
    last stage hands them to the loss - not from the checkpoint or export code, so a value the
    export gets wrong (a stale shard, a rounding, a swapped block) shows here.
It also prints the largest difference between the export's logits and the reference model's,
without a verdict. AdamW's step for an element is about lr * g / (|g| + eps), so where a gradient
is near eps (1e-8) - a vocabulary row whose token is rare in the batches - rounding differences of
a few 1e-7 between two correct runs (the layouts' orders of sums; the fused kernels against
transformers' ops) change that element's step by a sizeable part of lr: with a Qwen2 of hidden 64,
seq 160, in one process, a few logits differed from the reference's by 3.0e-4 after 3 steps while
the losses agreed to 9e-8, and with eps = 1e-6 the same runs' logits agreed to 3.4e-6.

--param-dtype bfloat16 is ZeRO's mixed precision (parallelize's param_dtype; torchtitan's
--training.mixed_precision_param, FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)): every parameter gathered and computed in bfloat16 from float32 masters,
the gradients added over microbatches and reduced in float32, AdamW on the masters; it needs
--zero 1-3 (refused up front otherwise). The reference then trains that arithmetic by hand: per
dp replica's rows and per microbatch, a copy of the float32 model with bfloat16 parameters (the
fused kernels swapped in, as parallelize does: in bfloat16 they round differently from the
model's modules), its gradients added and averaged over the replicas in float32 into the float32
model, AdamW there. The export (the float32 masters) is checked cast the same way (bfloat16
parameters, fused kernels), since the parallel model's logits are bfloat16 arithmetic. Measured,
small Llama, 3 steps (10 where said), relative differences:

  layout (bfloat16)               losses, correct   export, correct   export, 4 head rows x 0.97
  dp2 ZeRO-1 / ZeRO-3             4.3e-8 (10: 4.5e-8)  0                1.8e-2
  pp2 x dp2 ZeRO-1 (4 microb.)    3.3e-8 (10: 7.6e-8)  0
  dp2 ZeRO-3 --lora 8             4.3e-8              0
  tp2 x dp2 ZeRO-3                9.4e-5 (10: 9.4e-5)  5.3e-3 (10: 6.3e-3)  2.0e-2
  Mixtral dp2 ZeRO-3 --expert-parallel  3.5e-5        3.8e-3

and with a wrong reference, against the correct parallel run (losses): computing in float32
1.3e-5 - 6.1e-5, without the fused kernels 1.4e-5 - 5.4e-5, gradients added in bfloat16
7.7e-7 (LoRA) - 2.2e-5 (pp), the final norm's weight not trained 3.7e-6 - 2.4e-5. Without tensor
or expert parallelism the layout is the reference bit for bit but for the float32 mean of the
replicas' losses: tolerance 3e-7 for the losses (every wrong variant is above it, the closest
2.6x), 1e-5 for the export. With them, bfloat16 partial sums round apart from one process's (at
step 1, before any update, tp2's loss is already 1.5e-5 off): 5e-4 and 1e-2, which pass the
correct runs with margin but catch only errors larger than that rounding - a wrong shard, the
corrupted export (2.0e-2) - not the wrong variants above (3.5e-5 - 9.4e-5 at tp2, inside the noise).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import datetime
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from parallel_layers import checkpoint, fused, hf, init_parallel, parallelize
from parallel_layers.pipeline import SCHEDULES
from parallel_layers.pipeline.hf import causal_lm_loss

# float32, same batches: the layouts differ from one process only in the order of sums (TP
# reductions, gradient averaging); ~1e-6 relative over a few steps. 1e-4 (the bound)
# still catches a wrong gradient or a wrongly sharded weight.
PARITY_RTOL = 1e-4
# The export's forward (plain transformers) against the parallel model's (fused kernels, the
# layout's orders of sums) on the same weights: ~1e-6. A wrong value in the export is far above.
EXPORT_RTOL = 1e-5
# --param-dtype: the dtype parallelize's param_dtype gathers and computes in (None: the model's own)
PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
# --param-dtype bfloat16 (measured: the module doc). Without tensor or expert parallelism the
# layout computes what the reference does, bit for bit: the losses differ by the float32 mean
# over the replicas (<= 7.6e-8), the like-for-like export's logits by 0. With them, bfloat16
# partial sums (TP's row-parallel outputs, the experts' combine) round apart from one process's.
BF16_PARITY_RTOL, BF16_PARITY_RTOL_SPLIT = 3e-7, 5e-4
BF16_EXPORT_RTOL, BF16_EXPORT_RTOL_SPLIT = EXPORT_RTOL, 1e-2


def tolerances(args) -> tuple[float, float]:
    """(losses, export) tolerances for this run's dtype and layout (the module doc's measurements)."""
    if args.param_dtype == "float32":
        return PARITY_RTOL, EXPORT_RTOL
    split = args.tp > 1 or args.expert_parallel not in (None, 1)
    return (BF16_PARITY_RTOL_SPLIT, BF16_EXPORT_RTOL_SPLIT) if split else (BF16_PARITY_RTOL, BF16_EXPORT_RTOL)


def small_llama(directory: str, seed: int) -> None:
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def global_batch(step: int, args, vocab: int) -> torch.Tensor:
    """The step's global batch of token ids [batch, seq], the same on every rank; the labels are
    the ids themselves (Hugging Face's convention: the loss shifts them)."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, vocab, (args.batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (args.batch_size, 1), generator=g)
    return (start + stride * torch.arange(args.seq_len)) % vocab


class CausalLMLoss:
    """Hugging Face's causal-LM loss, on the model's output (not pipelined) or the last stage's
    logits. While `record` is a list, each call also appends its (labels, logits)."""

    def __init__(self):
        self.record: list | None = None

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        if self.record is not None:
            self.record.append((labels.detach().clone(), logits.detach().float().clone()))
        return causal_lm_loss(logits, labels)


loss_fn = CausalLMLoss()


def parallel_logits(par, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The trained parallel model's own (ids, logits) on this rank's rows `ids`, through its
    training step's forward (the pipeline's last stage hands the logits to the loss), in eval
    mode; every rank's gathered to rank 0 (elsewhere: []). The backward it also runs is discarded."""
    par.module.eval()
    loss_fn.record = []
    par.forward_backward(ids, ids)
    par.zero_grad()
    mine, loss_fn.record = loss_fn.record, None
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    return [pair for records in every for pair in records] if every is not None else []


def save_tokenizer(model_dir: str, export_dir: str) -> None:
    """The source's tokenizer beside the export, so that `AutoTokenizer.from_pretrained(export)`
    works: a model's save_pretrained (transformers' or hf.save_pretrained) writes no tokenizer."""
    import transformers

    if any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(export_dir)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude; inf when the shapes differ."""
    if got.shape != want.shape:
        return float("inf")
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def load_adapter(model_dir: str, export_dir: str):
    """The exported adapter on the base model from its files, as a peft user loads it."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, export_dir)


def adamw(args):
    return lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)


def agreed_directory(path: str | None, rank: int) -> str:
    """`path`, or a fresh temporary directory rank 0 makes and every rank is told."""
    name = [path or (tempfile.mkdtemp(prefix="finetune_hf-") if rank == 0 else None)]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def with_lora(model, args):
    """`model` adapted by peft (--lora), with the same initial adapters on every rank and in the
    reference."""
    import peft

    torch.manual_seed(args.seed + 1)
    return peft.get_peft_model(model, peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                      target_modules="all-linear", lora_dropout=0.0))


def in_param_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose parameters are `dtype` (its buffers as they are: rotary's inv_freq
    stays float32): what ZeRO's gather under param_dtype computes with."""
    low = copy.deepcopy(model)
    for q in low.parameters():
        q.data = q.data.to(dtype)
    return low


def mixed_precision_backward(master: torch.nn.Module, ids: torch.Tensor, dp: int, microbatches: int,
                             dtype: torch.dtype) -> float:
    """parallelize(param_dtype=dtype)'s gradients of the global batch `ids` by hand, into the
    float32 `master`'s .grad; returns the loss (the mean over the replicas of their microbatches'
    mean). Each dp replica's rows through a copy of the master whose parameters are `dtype`; each
    microbatch's gradient (of a 1 / microbatches share of its mean) added in float32 and averaged
    over the replicas in float32, as ZeRO does (Note [accumulating in the reduce dtype] in
    parallel_layers/zero/_param.py; the by-hand reference of tests/hf/test_mixed_precision.py)."""
    trained = [p for p in master.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    mean = 0.0
    for rows in ids.chunk(dp):
        low = in_param_dtype(master, dtype)
        for micro in rows.chunk(microbatches):
            loss = loss_fn(low(input_ids=micro), micro) / microbatches
            loss.backward()
            mean += loss.item() / dp
            for p, q in zip(master.parameters(), low.parameters()):
                if p.requires_grad:
                    p.grad += q.grad.float() / dp
                    q.grad = None
    return mean


def reference(model_dir: str, args, dp: int) -> tuple[list[float], torch.nn.Module]:
    """The same training in one process: the plain transformers model. In float32, whole global
    batches (the layouts differ from it in the order of sums only). With --param-dtype bfloat16,
    the same mixed-precision arithmetic as the parallel model's (`mixed_precision_backward`), on
    the model with the fused kernels parallelize swaps in (they round differently in bfloat16;
    in float32 the plain modules agree with them to ~1e-7)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.lora:
        model = with_lora(model, args)
    dtype = PARAM_DTYPES[args.param_dtype]
    if dtype is not None:
        fused.fuse(model)
    opt = adamw(args)(model.parameters())
    losses = []
    for step in range(args.steps):
        ids = global_batch(step, args, model.config.vocab_size)
        if dtype is None:
            loss = loss_fn(model(input_ids=ids), ids)
            loss.backward()
            loss = loss.item()
        else:
            loss = mixed_precision_backward(model, ids, dp, args.microbatches, dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses, model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="a save_pretrained directory (default: make a small Llama)")
    ap.add_argument("--work-dir", default=None, help="where the made model, checkpoints and export go "
                    "(default: a temporary directory, removed at the end)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / (tp * pp))")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                    help="0: DataParallel over dp; 1-3: ZeRO stage (default: 1 with --pp > 1, else 0)")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=None, help="per step (default: 2 * pp with --pp > 1, else 1)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp > 1: split the activations between the tensor-parallel regions on the sequence "
                         "(with --pp too: the stages exchange each rank's chunk); --seq-len must divide by tp")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train LoRA adapters of rank R (peft) on every linear layer of the decoder, the base frozen")
    ap.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                    help="recompute each decoder layer in backward: all of it, or all but its GEMM outputs")
    ap.add_argument("--expert-parallel", type=int, nargs="?", const=-1, default=None, metavar="EP",
                    help="a mixture of experts' experts spread over the dp ranks, tokens sent by all-to-all; with "
                         "EP (a divisor of dp), over groups of EP consecutive dp ranks, replicated over dp / EP")
    ap.add_argument("--param-dtype", default="float32", choices=list(PARAM_DTYPES),
                    help="bfloat16: ZeRO's mixed precision (parallelize's param_dtype, FSDP2's MixedPrecisionPolicy): "
                         "parameters gathered and computed in bfloat16, float32 masters, gradients added and reduced "
                         "in float32; needs --zero 1-3")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (sequences), split over dp")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    if args.model_dir is not None and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        raise SystemExit(f"--model-dir {args.model_dir}: no config.json there; it must be a directory written by "
                         "save_pretrained (config.json and model.safetensors), or left out for the demo's "
                         "small Llama")
    args.zero = args.zero if args.zero is not None else (1 if args.pp > 1 else 0)
    args.microbatches = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    if args.param_dtype != "float32" and not args.zero:  # every rank, before any collective
        raise SystemExit(f"--param-dtype {args.param_dtype} needs ZeRO: it is ZeRO's mixed precision (parameters "
                         f"gathered in {args.param_dtype} from float32 masters); got --zero 0 (DataParallel, the "
                         "default without --pp). Pass --zero 1, 2 or 3, or --param-dtype float32")
    ctx = init_parallel(tp=args.tp, pp=args.pp, dp=args.dp, device="cpu")
    # rank 0's one-process replay may outlast a collective's timeout: the others wait for its
    # verdict on a group of their own
    verdict_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    rank, world, dp = dist.get_rank(), dist.get_world_size(), ctx.dims.dp
    if args.batch_size % (dp * args.microbatches):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by dp ({dp}) * microbatches "
                         f"({args.microbatches}) = {dp * args.microbatches}")
    work = agreed_directory(args.work_dir, rank)
    if args.work_dir is None:  # removed on a failure too, by whichever rank exits (one node: one directory)
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    model_dir = args.model_dir or os.path.join(work, "pretrained")
    if args.model_dir is None and rank == 0:
        small_llama(model_dir, args.seed)
    dist.barrier()

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dist.barrier()  # every rank has read the directory before any can fail and remove it
    vocab = model.config.vocab_size
    pipelined = args.pp > 1 or args.microbatches > 1
    if args.lora:
        model = with_lora(model, args)
    # a pipeline cuts the transformers model inside peft's wrapper (its LoRA layers with it)
    target = model.get_base_model() if args.lora and pipelined else model
    par = parallelize(target, ctx, optimizer=adamw(args), loss_fn=loss_fn, tp_plan="auto" if args.tp > 1 else None,
                      activation_checkpointing=None if args.activation_checkpointing == "none"
                      else args.activation_checkpointing, zero_stage=args.zero,
                      pipeline_layers="auto" if pipelined else None, schedule=args.schedule,
                      microbatches=args.microbatches, sequence_parallel=args.sequence_parallel,
                      expert_parallel={None: False, -1: True}.get(args.expert_parallel, args.expert_parallel),
                      param_dtype=PARAM_DTYPES[args.param_dtype])
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        ids = global_batch(step, args, vocab).chunk(dp)[ctx.coordinate("dp")]
        mean = par.forward_backward(ids, ids).clone()
        par.step()
        par.zero_grad()
        dist.all_reduce(mean, group=ctx.dp_group)
        losses.append(mean.item() / dp)
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    saved = checkpoint.save(os.path.join(work, "checkpoints"), args.steps, par.module, par.optimizer,
                            prefix=par.prefix, extra={"losses": losses})
    export_dir = hf.save_pretrained(par.module, os.path.join(work, "export"))
    if rank == 0:
        save_tokenizer(model_dir, export_dir)
    probe = global_batch(args.steps, args, vocab)  # a batch no step trained on
    trained = parallel_logits(par, probe.chunk(dp)[ctx.coordinate("dp")])

    verdict = torch.zeros(1)
    if rank == 0:
        ref_losses, ref_model = reference(model_dir, args, dp)
        dtype = PARAM_DTYPES[args.param_dtype]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32) \
            if not args.lora else load_adapter(model_dir, export_dir)
        # the export computing as the parallel model does: under --param-dtype its float32 files cast
        # to bfloat16 parameters with the fused kernels (its float32 forward: ~6e-3 off, a real
        # rounding, not an export error)
        like = exported
        if dtype is not None:
            like = in_param_dtype(exported, dtype)
            fused.fuse(like)
        with torch.no_grad():
            export_diff = max((relative(like(input_ids=ids).logits, logits) for ids, logits in trained),
                              default=float("inf"))
            ref_diff = relative(exported(input_ids=probe).logits, ref_model(input_ids=probe).logits)
        parity_rtol, export_rtol = tolerances(args)
        ok_loss, ok_export = loss_diff <= parity_rtol, export_diff <= export_rtol
        verdict[0] = float(ok_loss and ok_export)
        print(f"model: {type(model).__name__} from {model_dir}")
        pipeline = f", {args.schedule} schedule, {args.microbatches} microbatches" if pipelined else ""
        recompute = ("" if args.activation_checkpointing == "none"
                     else f", {args.activation_checkpointing} activation checkpointing")
        experts = {None: "", 1: "", -1: ", experts over dp"}.get(args.expert_parallel,
                                                                  f", experts over groups of {args.expert_parallel} dp ranks")
        print(f"layout: dp={dp} x tp={args.tp} x pp={args.pp} on {world} process(es), "
              f"{'ZeRO-' + str(args.zero) if args.zero else 'DataParallel' if dp > 1 else 'no data parallelism'}"
              f"{pipeline}{recompute}{experts}, plan: {'the published one' if args.tp > 1 else 'none'}"
              f"{', sequence parallel' if args.sequence_parallel else ''}"
              f"{f', LoRA rank {args.lora} (peft)' if args.lora else ''}"
              f"{f', parameters in {args.param_dtype} (float32 masters)' if dtype is not None else ''}")
        print(f"{'time per step':28s} {elapsed / args.steps * 1e3:.1f} ms")
        print(f"{'checkpoint':28s} {saved}" + (" (removed at the end; --work-dir keeps it)" if args.work_dir is None
                                                else ""))
        print(f"parity vs plain transformers: final loss {losses[-1]:.6f} vs {ref_losses[-1]:.6f}, max relative "
              f"difference over {args.steps} steps {loss_diff:.2e} (tolerance {parity_rtol:g}): "
              f"{'PASS' if ok_loss else 'FAIL'}")
        print(f"export {export_dir} reloaded by from_pretrained: logits vs the trained parallel model's own on an "
              f"unseen batch, max relative difference {export_diff:.2e} (tolerance {export_rtol:g}): "
              f"{'PASS' if ok_export else 'FAIL'}")
        print(f"{'':28s} (its logits vs the reference model's: max relative difference {ref_diff:.2e}; no verdict, "
              "see the module doc)")
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    dist.broadcast(verdict, src=0, group=verdict_group)
    ctx.shutdown()
    if verdict.item() != 1.0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
