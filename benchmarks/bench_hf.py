"""A Hugging Face Llama training step: ours vs the PyTorch-native stacks at tp=2 and at dp=2.

    python benchmarks/bench_hf.py [--hidden 512 1024] [--layers 4] [--dtypes float32 bfloat16]
                                  [--batch 1 --seq 256] [--reps 6] [--trials 3]
                                  [--adamw fused|foreach|default] [--model llama|mixtral|phi3]

The model, for each --hidden h: a transformers LlamaConfig with h / 64 heads and h / 256
key-value heads (grouped-query attention; at least 4 and 2), a SwiGLU MLP of 8h/3 rounded up to
a multiple of 32 (1376 at h = 512), --layers decoder layers, an untied head and a vocabulary of
--vocab (4096: small, so that the decoder layers dominate the step as in a large model; with
LlamaConfig's default 32000 the embedding, head and their gradients would be most of a model
this size). It is built from the config, saved with `save_pretrained` and every variant loads it back
with `from_pretrained` (nothing is downloaded). A step is forward + Hugging Face's causal-LM
loss + backward + AdamW step + zero_grad on [--batch, --seq] token ids, the same ids for every
variant, two processes on gloo, one thread each. Variants, each set up as its documentation
advises:

  tp=2  ours:       parallel_layers.parallelize(model, init_parallel(tp=2), tp_plan="auto"):
                    the plan the model publishes, no plan of our own
        hf_tp:      transformers' from_pretrained(dir, distributed_config=DistributedConfig(
                    tp_plan="auto")) (DTensor; tp_plan="auto" as a keyword is its deprecated spelling)
  dp=2  zero3:      parallelize(model, init_parallel(dp=2), zero_stage=3): its default units, the
                    decoder layers, the embedding and the head (Note [vocabulary units])
        fsdp2:      torch.distributed.fsdp.fully_shard on each decoder layer, then on the root
                    (reshard_after_forward at its default, None: True for the layers, False for
                    the root, which backward uses first)
        ddp:        torch.nn.parallel.DistributedDataParallel
        and, so that the kernels and the data parallelism are measured apart (review finding,
        helper-62: zero3 and ours run parallelize's fused kernels by default, fused_kernels=True,
        and the peers the model as transformers builds it):
        zero3_unfused: zero3 with fused_kernels=False (the model's own modules, as the peers run it)
        ddp_fused:  DDP over the model after parallel_layers.fused.fuse (what a DDP user of our
                    kernels runs)
        zero3 / ddp is what a user gets switching stacks; zero3_unfused / ddp and zero3 /
        ddp_fused are ZeRO-3 against DDP with the same kernels on both sides.
(each rank of dp=2 has its own batch of --batch sequences). The variants of one axis are built
together in a pair of processes and timed round-robin, one step of each per round
(_common.time_interleaved), their order reversed on every other trial, then freed before the next
axis's; each of --trials is a fresh pair of processes; a ratio
is the median over trials of the ratio within each trial. --dtypes: float32, or bfloat16.
bfloat16 at tp=2: both models loaded in bfloat16 (TP keeps no master copy). bfloat16 at dp=2,
--bf16 mixed (the default): every variant keeps float32 weights, float32 gradient reductions
and a float32 AdamW, and runs its GEMMs in bfloat16, as each one's documentation advises for
mixed precision: ZeRO over the model loaded in bfloat16 (its shards are float32 masters,
reduce_dtype float32), FSDP2 over the float32 model with MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32) (torchtitan's default), both computing everything in bfloat16;
DDP over the float32 model under torch.autocast(bfloat16), which runs only autocast's listed ops
(the GEMMs) in bfloat16 and keeps the residual stream, norms and embedding in float32 and casts
the weights at each use - not the same work as the others (review finding, helper-72). --bf16 pure: FSDP2 and DDP over the model loaded in bfloat16 (bfloat16
weights, reductions and AdamW state: less work, and less accurate, than ZeRO, which has no
such mode and still keeps float32 masters).
--adamw: torch.optim.AdamW's implementation, the same for every variant: `fused` (the default
here, and torchtitan's), `foreach`, or `default`, what AdamW(params, lr) picks - on CPU its
for-loop over the parameters. On one thread of the 2-core EPYC the for-loop took 45 ms for the
whole model at hidden 512 and 194 ms at 1024 (12-14% of a DDP step), fused 9.4 and 29.6 ms.
ZeRO and FSDP step half the parameters on each rank and DDP all of them, so the for-loop
favours ZeRO against DDP and fused is the harder comparison. (Result files without an "adamw"
entry in their args are from runs before this option, which used `default`.) transformers'
tp_plan="auto" leaves the parameters it does not shard as plain tensors, which the foreach and
fused kernels refuse to mix with its DTensors: for those two, each variant's DTensor and plain
parameters go in separate parameter groups (as a user of that plan would have to).
Writes benchmarks/results/bench_hf.json (every trial's times) and bench_hf.png.
--lora R: a LoRA fine-tune instead. Every variant loads the model as above and adapts it with
peft.get_peft_model(model, LoraConfig(r=R, lora_alpha=2R, target_modules="all-linear",
lora_dropout=0.0)) (examples/finetune_hf.py's with_lora), the same initial adapters in every
variant and on every rank (torch.manual_seed(1) first); only the adapters train, AdamW over the
parameters that require grad. Variants:
  tp=2  ours:         parallelize(peft_model, init_parallel(tp=2), tp_plan="auto"): its LoRA layers
                      split with their base layers (tensor_parallel/lora.py), as finetune_hf.py --lora
        hf_tp:        transformers' tp_plan="auto" model, then get_peft_model over it (if it fails,
                      the error is printed and the variant left out)
  dp=2  dataparallel: parallelize(peft_model, init_parallel(dp=2), zero_stage=0)
        zero1, zero3: the same with zero_stage=1, 3 (ZeRO-3's default units)
        zero3_unfused: zero3 with fused_kernels=False (the model's own modules, as the peers run it)
        zero3_mp:     --bf16 mixed bfloat16 only: zero3 over the float32 model with
                      param_dtype=torch.bfloat16, FSDP2's mixed precision policy as fsdp2 gets it
                      (the adapters compute in bfloat16; Note [mixed precision by the parameters])
        fsdp2:        fully_shard on each decoder layer, then on the root, the frozen base weights and
                      the adapters in the same units (FSDP2 shards per parameter, so mixed
                      requires_grad in a unit is allowed; torchtune's LoRA recipes shard so)
        ddp:          DistributedDataParallel over the peft model
  Each variant's losses over the warm-up and timed steps (the same batch every step) are
  recorded, and which of our modules ran fused (fused.py leaves peft's LoRA layers alone).
Targets: ours / hf_tp <= 0.85; zero3 / fsdp2 <= 0.85 and zero3 / ddp <= 1.15 (the same-kernel
zero3_unfused / ddp and zero3 / ddp_fused are held to 1.15 too).
--model mixtral: the same step on a Mixtral of the same attention, with 8 experts of the Llama's
MLP width and 2 per token (Mixtral 8x7B's shape: experts of 3.5 x hidden); at tp=2 ours splits
each expert as its MLP (tensor_parallel/experts.py), as transformers' "moe_tp_experts" does,
and with --whole-experts a third variant, ours_experts, gives each rank 4 whole experts instead
(Experts(split="experts"), Note [whole experts per rank]), held to the same target; at
dp=2 a fourth variant, zero3_ep: ZeRO-3 with expert_parallel=True (each rank 4 whole experts,
tokens exchanged by all-to-all; parallel_layers/expert_parallel.py), the layout torchtitan and
Megatron train mixtures of experts with; its ratios are held to ZeRO-3's targets.
--model phi3: the Llama's shape as a Phi-3 (q, k, v packed in qkv_proj, gate and up in
gate_up_proj). Its published plan gathers both packed outputs; ours gathers qkv_proj's too (its
attention slices at the model's head count) but splits gate_up_proj block by block, with no
gather, and fuses the MLP (Note [packed MLPs split block by block] in tensor_parallel/plan.py).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine, spawn, time_interleaved, write_json  # noqa: E402

AXES = {"tp": ("ours", "hf_tp"), "dp": ("zero3", "fsdp2", "ddp", "zero3_unfused", "ddp_fused")}
# a mixture of experts also runs ZeRO-3 with its experts spread over dp (expert_parallel=True)
MOE_AXES = {"tp": AXES["tp"], "dp": ("zero3", "zero3_ep", "fsdp2", "ddp")}
# (numerator, denominator, target): the targets for each ratio of step times; the
# expert-parallel ZeRO-3 is held to ZeRO-3's
RATIOS = (("ours", "hf_tp", 0.85), ("ours_experts", "hf_tp", 0.85), ("zero3", "fsdp2", 0.85), ("zero3", "ddp", 1.15),
          ("zero3_ep", "fsdp2", 0.85), ("zero3_ep", "ddp", 1.15),
          # the same kernels on both sides: unfused, and fused (the target held to zero3 / ddp's)
          ("zero3_unfused", "ddp", 1.15), ("zero3", "ddp_fused", 1.15))
# --lora R: a LoRA fine-tune (peft); its variants and ratios (the targets borrowed from the
# full fine-tune's: 0.85 against a sharding / TP peer, 1.15 against DDP)
LORA_AXES = {"tp": ("ours", "hf_tp"),
             "dp": ("dataparallel", "zero1", "zero3", "zero3_mp", "zero3_unfused", "fsdp2", "ddp")}
LORA_RATIOS = (("ours", "hf_tp", 0.85), ("zero3", "fsdp2", 0.85), ("zero3", "ddp", 1.15),
               ("zero3_mp", "fsdp2", 0.85), ("zero3_mp", "ddp", 1.15),
               ("zero3_unfused", "fsdp2", 0.85), ("zero3_unfused", "ddp", 1.15),
               ("zero1", "ddp", 1.15), ("dataparallel", "ddp", 1.15), ("dataparallel", "fsdp2", 0.85))
# --adamw: torch.optim.AdamW's implementations, the same one for every variant
ADAMW_IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def llama_config(hidden: int, layers: int, vocab: int, seq: int):
    import transformers

    heads = max(4, hidden // 64)  # tp=2 needs at least 2 key-value heads: 4 heads at the smoke test's sizes
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=32 * math.ceil(8 * hidden / 3 / 32),
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=max(2, heads // 4), vocab_size=vocab,
                                    max_position_embeddings=max(seq, 512), tie_word_embeddings=False)


def mixtral_config(hidden: int, layers: int, vocab: int, seq: int):
    import transformers

    llama = llama_config(hidden, layers, vocab, seq)
    return transformers.MixtralConfig(hidden_size=hidden, intermediate_size=llama.intermediate_size,
                                      num_hidden_layers=layers, num_attention_heads=llama.num_attention_heads,
                                      num_key_value_heads=llama.num_key_value_heads, vocab_size=vocab,
                                      max_position_embeddings=llama.max_position_embeddings,
                                      tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)


def phi3_config(hidden: int, layers: int, vocab: int, seq: int):
    import transformers

    llama = llama_config(hidden, layers, vocab, seq)
    return transformers.Phi3Config(hidden_size=hidden, intermediate_size=llama.intermediate_size,
                                   num_hidden_layers=layers, num_attention_heads=llama.num_attention_heads,
                                   num_key_value_heads=llama.num_key_value_heads, vocab_size=vocab,
                                   max_position_embeddings=llama.max_position_embeddings, sliding_window=None,
                                   tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


CONFIGS = {"llama": llama_config, "mixtral": mixtral_config, "phi3": phi3_config}


def with_lora(model, lora: int):
    """`model` adapted by peft as examples/finetune_hf.py's with_lora does, the same initial
    adapters in every variant and on every rank."""
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear",
                                                      lora_dropout=0.0))


def fused_summary(model) -> dict[str, int]:
    """How many modules of each kind of ours `model` runs (fused or tensor-parallel), and its
    decoder layers given the fused residual add; LoRA layers of peft's are counted apart."""
    import functools

    from parallel_layers import _peft, fused

    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        cls = type(m)
        key = None
        if cls.__module__.startswith("parallel_layers"):
            key = cls.__name__
        elif isinstance(vars(m).get("forward"), functools.partial) and \
                vars(m)["forward"].func is fused._decoder_layer_forward:
            key = f"{cls.__name__} (fused residual add)"
        elif _peft.is_lora_layer(m):
            key = f"peft {cls.__name__} (base: {type(m.base_layer).__name__})"
        if key:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _variant(kind: str, model_dir: str, dtype: torch.dtype, bf16: str = "mixed", adamw_impl: str = "fused",
             lr: float = 1e-4, lora: int = 0, info: dict | None = None):
    """(step function of token ids) for one variant, built in this process; the step returns
    its loss. info: filled with what ran fused (ours)."""
    import transformers

    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    def loss_fn(output, ids):
        return causal_lm_loss(output.logits, ids)

    def adamw(params):
        params = [p for p in params if p.requires_grad] if lora else list(params)
        if adamw_impl != "default":
            # transformers' tp_plan leaves the parameters it does not shard as plain tensors, and
            # the foreach / fused kernels refuse a list that mixes them with DTensors: one
            # parameter group of each
            from torch.distributed.tensor import DTensor

            kinds = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
            params = [{"params": ps} for ps in kinds if ps]
        return torch.optim.AdamW(params, lr=lr, **ADAMW_IMPLS[adamw_impl])

    if kind == "hf_tp":
        from transformers.distributed import DistributedConfig

        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"))
        if lora:
            model = with_lora(model, lora)
        return _plain_step(model, adamw(model.parameters()), loss_fn)
    # Mixed precision keeps float32 weights: FSDP2 and DDP take the float32 model and cast (below).
    mixed = dtype == torch.bfloat16 and bf16 == "mixed" and kind in ("fsdp2", "ddp", "ddp_fused", "zero3_mp")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if mixed else dtype)
    if lora:
        model = with_lora(model, lora)
    if kind in ("ours", "ours_experts", "zero3", "zero3_ep", "zero3_unfused", "zero3_mp", "dataparallel", "zero1"):
        ctx = init_parallel(tp=2 if kind in ("ours", "ours_experts") else 1, device="cpu")
        plan = "auto" if kind == "ours" else None
        if kind == "ours_experts":  # whole experts per TP rank (Note [whole experts per rank])
            from parallel_layers.tensor_parallel.experts import Experts
            from parallel_layers.tensor_parallel.plan import published_plan

            plan = {**published_plan(model), "model.layers.*.mlp.experts": Experts(split="experts")}
        stage = {"ours": 0, "dataparallel": 0, "zero1": 1}.get(kind, 3)
        par = parallelize(model, ctx, optimizer=adamw, loss_fn=loss_fn, tp_plan=plan,
                          zero_stage=stage, expert_parallel=kind == "zero3_ep",
                          fused_kernels=kind != "zero3_unfused",
                          param_dtype=torch.bfloat16 if kind == "zero3_mp" and mixed else None)
        if info is not None:
            info["fused"] = fused_summary(par.module)

        def step(ids):
            loss = par.forward_backward(ids, ids)
            par.step()
            par.zero_grad()
            return loss
        return step
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (2,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
            MixedPrecisionPolicy()
        for layer in (model.get_base_model() if lora else model).model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return _plain_step(model, adamw(model.parameters()), loss_fn)
    if kind == "ddp_fused":
        from parallel_layers import fused

        fused.fuse(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return _plain_step(ddp, adamw(ddp.parameters()), loss_fn, autocast=mixed)


def _plain_step(model, opt, loss_fn, autocast: bool = False):
    def step(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(input_ids=ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _rank(rank, ws, axes, model_dir, dtype_name, batch, seq, vocab, reps, reverse, bf16, adamw_impl, model,
          lora=0, whole_experts=False):
    # transformers' distributed loading reads the torchrun variables; the process group is ours
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws))
    times = {}
    extra = {"losses": {}, "fused": {}, "failed": {}}
    for axis in axes:  # one axis's variants at a time: the others' memory is freed first
        kinds = (LORA_AXES if lora else MOE_AXES if model == "mixtral" else AXES)[axis]
        if whole_experts and model == "mixtral" and axis == "tp":
            kinds = ("ours", "ours_experts", "hf_tp")
        if dtype_name != "bfloat16" or bf16 != "mixed":  # zero3_mp is zero3 there
            kinds = tuple(k for k in kinds if k != "zero3_mp")
        kinds = kinds[::-1] if reverse else kinds
        steps = {}
        for kind in kinds:
            info = {}
            try:
                steps[kind] = _variant(kind, model_dir, getattr(torch, dtype_name), bf16, adamw_impl, lora=lora,
                                       info=info)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run LoRA is reported, not timed
                if not (lora and kind == "hf_tp"):
                    raise
                extra["failed"][kind] = f"{type(e).__name__}: {e}"
                continue
            if "fused" in info:
                extra["fused"][kind] = info["fused"]
        if lora and "hf_tp" in steps:  # get_peft_model may succeed and the step fail: try one
            try:
                probe = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(99))
                hf = _variant("hf_tp", model_dir, getattr(torch, dtype_name), bf16, adamw_impl, lora=lora)
                hf(probe)
                del hf
            except Exception as e:  # noqa: BLE001
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-3:]
                extra["failed"]["hf_tp"] = f"{type(e).__name__}: {e} (at " + " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(where)) + ")"
                del steps["hf_tp"]
        # tp: every rank the same batch; dp: each rank its own
        g = torch.Generator().manual_seed(rank if axis == "dp" else 0)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        if lora:  # each step's loss, recorded (a float per step: negligible next to the step)
            for kind in steps:
                extra["losses"][kind] = []

            def run(kind, fn):
                extra["losses"][kind].append(float(fn(ids).detach()))
            fns = {kind: (lambda kind=kind, fn=fn: run(kind, fn)) for kind, fn in steps.items()}
        else:
            fns = {kind: (lambda fn=fn: fn(ids)) for kind, fn in steps.items()}
        times.update(time_interleaved(fns, reps))
        del steps, fns
        gc.collect()
    return (times, extra) if lora else times


def plot(results: dict, path: Path, model: str = "llama", ratio_table=RATIOS) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(configs) + 2), 3.8))
    width = 0.8 / len(ratio_table)
    for i, (a, b, target) in enumerate(ratio_table):
        xs = [j + (i - (len(ratio_table) - 1) / 2) * width for j in range(len(configs))]
        ax.bar(xs, [results[c]["ratios"].get(f"{a}_over_{b}", math.nan) for c in configs], width,
                      label=f"{a} / {b} (target <= {target})")
        for x in xs:  # each bar's target, drawn over the bars
            ax.hlines(target, x - width / 2, x + width / 2, colors="k", linestyles="dashed", lw=1, zorder=3)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(configs)), configs)
    ax.set(ylabel="step time ratio (lower: ours faster)", title=f"Hugging Face {model.capitalize()} step, 2 ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096,
                    help="small, so that the decoder layers and not the embedding and head dominate the step")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (per rank at dp=2)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--axes", nargs="+", choices=list(AXES), default=list(AXES))
    ap.add_argument("--bf16", choices=["mixed", "pure"], default="mixed",
                    help="dp=2 in bfloat16: FSDP2 / DDP with float32 weights and reductions (mixed, as their docs "
                         "advise and as ZeRO does) or all in bfloat16 (pure)")
    ap.add_argument("--adamw", choices=list(ADAMW_IMPLS), default="fused",
                    help="torch.optim.AdamW's implementation, the same for every variant ('default': what "
                         "AdamW(params, lr) picks, the for-loop one on CPU)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--trials", type=int, default=3, help="fresh process pairs; ratios are medians over them")
    ap.add_argument("--model", choices=list(CONFIGS), default="llama")
    ap.add_argument("--name", default="bench_hf", help="result file name under benchmarks/results/")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="a LoRA fine-tune (peft, rank R, every linear layer of the decoder; only the adapters train) "
                         "instead of a full one; llama only")
    ap.add_argument("--whole-experts", action="store_true",
                    help="--model mixtral --axes tp: also time whole experts per TP rank (Experts(split='experts'))")
    args = ap.parse_args(argv)
    ratio_table = LORA_RATIOS if args.lora else RATIOS
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_hf-") as tmp:
        for hidden in args.hidden:
            import transformers

            model_dir = os.path.join(tmp, f"{args.model}-{hidden}")
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                CONFIGS[args.model](hidden, args.layers, args.vocab, args.seq))
            params = sum(p.numel() for p in model.parameters())
            model.save_pretrained(model_dir)
            del model
            for dtype in args.dtypes:
                config = f"h{hidden} {dtype}" + (f" ({args.bf16})" if dtype == "bfloat16" and "dp" in args.axes
                                                  else "")
                trials, extras = [], []
                for trial in range(args.trials):
                    ranks = spawn(_rank, 2, (args.axes, model_dir, dtype, args.batch, args.seq, args.vocab,
                                             args.reps, trial % 2 == 1, args.bf16, args.adamw, args.model,
                                             args.lora, args.whole_experts))
                    if args.lora:
                        extras.append([r[1] for r in ranks])
                        ranks = [r[0] for r in ranks]
                    times = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the slower rank's median
                    trials.append(times)
                ratios, trial_ratios = {}, {}
                for a, b, _ in ratio_table:
                    if a in trials[0] and b in trials[0]:
                        trial_ratios[f"{a}_over_{b}"] = [t[a] / t[b] for t in trials]
                        ratios[f"{a}_over_{b}"] = statistics.median(trial_ratios[f"{a}_over_{b}"])
                step_s = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
                results[config] = {"hidden": hidden, "dtype": dtype, "params": params, "step_s": step_s,
                                   "trials": trials, "trial_ratios": trial_ratios, "ratios": ratios}
                if args.lora:  # each trial's, each rank's: losses per step, what ran fused, what failed
                    results[config]["lora"] = extras
                print(f"{args.model} h={hidden} x {args.layers} layers ({params / 1e6:.1f}M params), {dtype}, "
                      f"[{args.batch}x{args.seq}] tokens, ms per step over {args.trials} trials:")
                for kind in step_s:
                    print(f"  {kind:13s} " + "  ".join(f"{t[kind] * 1e3:8.1f}" for t in trials))
                for a, b, target in ratio_table:
                    if f"{a}_over_{b}" in ratios:
                        per_trial = ", ".join(f"{v:.2f}" for v in trial_ratios[f"{a}_over_{b}"])
                        print(f"  {a} / {b} = {ratios[f'{a}_over_{b}']:.2f} (trials {per_trial}; target <= {target})")
                if args.lora:
                    first = extras[0]
                    for kind, why in first[0]["failed"].items():
                        print(f"  {kind} failed under LoRA: {why}")
                    for kind, counts in first[0]["fused"].items():
                        print(f"  {kind} runs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
                    for rank, extra in enumerate(first):
                        print(f"  losses, trial 1, rank {rank} (the same batch every step):")
                        for kind, losses in extra["losses"].items():
                            print(f"    {kind:13s} " + " ".join(f"{v:.6f}" for v in losses[:5]))
    load = os.getloadavg()
    path = write_json(args.name, {"benchmark": "hf", "machine": {**machine(), "loadavg_after": load},
                                  "args": vars(args), "results": results})
    plot(results, RESULTS / f"{args.name}.png", args.model, ratio_table)
    print(f"load average after the run {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; wrote {path}")


if __name__ == "__main__":
    main()
