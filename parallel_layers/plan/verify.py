"""`python -m parallel_layers.plan ... --verify N`: run the planner's top candidates on this
machine and compare what it predicted with what they hold and take.

    python -m parallel_layers.plan --hf-config my-llama/ --seq 128 --gpus 2 --gpus-per-node 2 \\
        --global-batch 8 --verify 2

The parent (`verify`) launches this module's worker once, under `torchrun --standalone
--nproc-per-node W`, with a timeout (past it the launcher and its workers are killed):
  1. rank 0 writes the Hugging Face model of the config, randomly initialised, as a
     save_pretrained directory (every rank imports transformers and the model's code now, so
     that the imports count in the baseline, not in a run);
  2. calibration: every rank measures its float32 GEMM rate (all ranks at once, as in
     training), the gloo all-reduce bandwidth over the W ranks, and the memory it holds before
     any model. Rank 0 plans for this machine with those numbers (`machine_cluster`: flops =
     the GEMM rate at mfu 1, both bandwidths = gloo's, memory per rank = the available memory
     / W minus that baseline) and takes the top candidates that parallel_layers can run;
  3. each candidate in turn: the model built on the meta device, `init_parallel` +
     `parallelize` with `plan.launch_args` (the composing API, as examples/finetune_hf.py
     calls it), `hf.load_pretrained` filling only this rank's part, then a few AdamW steps on
     random tokens. Per rank: the median step time after the first step, and the peak memory.
     With TrainSpec.lora_rank (--lora R) the meta model is adapted by peft first (`_with_lora`)
     and load_pretrained draws the adapters' initial values; only they train.

Note [measured peak]: the planner predicts the training state (params, grads, optimizer,
activations, the loss's temporaries), not the interpreter. On CPU a rank's peak is its resident
set's high-water mark (VmHWM) over the training steps minus its resident set right before the
model is built (torch and transformers imported, the process group up, the GEMM libraries' own
state set up by a first call: _warm_gemm_libraries). The high-water mark is
reset (/proc/self/clear_refs) after loading, so that reading the files (a transient of this
worker, not of training) is not counted; what the load leaves behind is. glibc is told to map
every allocation of 64 KiB or more on pages of its own (MALLOC_MMAP_THRESHOLD_), so that a freed
tensor leaves the resident set at once instead of staying in the heap, where the next
candidate's baseline would count it. Note [a first run's one-time state]: the first layout a
process trains keeps ~20 MB more than the same layout run after another (a tiny Llama at ZeRO-2
measured 1.08-1.10 of its estimate run first, 0.94 run second): state the libraries set up once
for the model's shapes and ops, which every later run finds in its baseline. So the first
candidate is trained for two steps, unmeasured, before any is measured. On CUDA: torch.cuda.max_memory_allocated over the steps
minus memory_allocated before the build.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_MMAP_THRESHOLD = 64 * 1024  # bytes; see Note [measured peak]


# ---- the plan for this machine ---------------------------------------------------------------
# Kinds of rejection (plan.reason_kind) that leave a layout runnable here: it fits and breaks
# no hard rule, it only lost to the recommendation.
_RUNNABLE = ("tie", "slower", "m < 4p", "fits without TP/PP")


def machine_cluster(calibration: list[dict], gpu_mem_bytes: float | None, device: str = "cpu"):
    """plan.ClusterSpec of this machine's W ranks: the slowest rank's measured GEMM rate (at mfu
    1: what the GEMMs reach is measured, not assumed), the slowest gloo all-reduce bandwidth on
    both levels (one node), and per rank `gpu_mem_bytes` or this machine's available memory / W
    minus what a rank holds before any model (Note [measured peak])."""
    from parallel_layers import plan

    world = len(calibration)
    if gpu_mem_bytes is None:
        gpu_mem_bytes = _available_memory(device) / world - max(c["baseline"] for c in calibration)
    bw = min(c["allreduce_bw"] for c in calibration)
    bw = bw if bw != float("inf") else 1e12  # world 1: no traffic, any bandwidth
    return plan.ClusterSpec(world, world, gpu_mem_bytes, flops=min(c["gemm_flops"] for c in calibration),
                            intra_node_bw=bw, inter_node_bw=bw, mfu=1.0)


def _available_memory(device: str) -> float:
    if device == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        return float(re.search(r"MemAvailable:\s+(\d+) kB", f.read()).group(1)) * 1024


def top_candidates(best, rejected, train, n: int, cuda: bool = False) -> tuple[list, list[str]]:
    """The first `n` layouts in the planner's order (the recommendation, then the closest
    rejected) that fit and that parallel_layers can run; and why the others before the last
    one taken were skipped."""
    from parallel_layers import plan

    chosen, skipped = [], []
    for e in ([best] if best else []) + list(rejected):
        if len(chosen) == n:
            break
        if e.reason is not None and plan.reason_kind(e.reason) not in _RUNNABLE:
            break  # the rest broke a rule or do not fit (rejected is ordered so)
        unsupported = plan.launch_args(e, train)["unsupported"]
        if e.layout.offload and not cuda:  # the offloaded state would be counted in the measured peak
            unsupported = [*unsupported, "optimizer offload on a CPU (host memory is the device's: measured together)"]
        if train.precision == "mixed" and train.lora_rank is None and e.layout.zero == 0:
            unsupported = [*unsupported, "mixed precision at ZeRO-0 (DataParallel holds no float32 masters: Note "
                                         "[mixed precision in the plan])"]
        if unsupported:
            skipped.append(f"{e.layout}: {', '.join(unsupported)}")
            continue
        chosen.append(e)
    return chosen, skipped


def _spec(cls, fields: dict):
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _dtype_names(launch: dict) -> dict:
    """launch_args with its torch dtypes as their names (the report is JSON); `_dtypes` undoes it."""
    import torch

    return {k: _dtype_names(v) if isinstance(v, dict) else str(v).removeprefix("torch.")
            if isinstance(v, torch.dtype) else v for k, v in launch.items()}


def _dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def _choose(job: dict, calibration: list[dict], device) -> tuple[dict, list[dict]]:
    """Rank 0: the planner's top candidates on the calibrated cluster, with their estimates."""
    import dataclasses

    from parallel_layers import plan

    model, train = _spec(plan.ModelSpec, job["model"]), _spec(plan.TrainSpec, job["train"])
    cluster = machine_cluster(calibration, job["gpu_mem_bytes"], device.type)
    best, rejected = plan.recommend(model, cluster, train)
    chosen, skipped = top_candidates(best, rejected, train, job["top"], cuda=device.type == "cuda")
    runs = [{"layout": str(e.layout), "launch": _dtype_names(plan.launch_args(e, train)), "recommended": e is best,
             "predicted": {"params": e.params, "grads": e.grads, "optimizer": e.optimizer,
                           "activations": e.activations, "loss_temporaries": e.loss_temporaries,
                           "grads_at_loss": e.grads_at_loss, "memory": e.memory, "step_time": e.step_time}}
            for e in chosen]
    return {**dataclasses.asdict(cluster), "skipped": skipped, "table": plan.format_plan(
        model, cluster, train, best, rejected, rows=job["rows"])}, runs


# ---- the parent: launch, wait, compare ------------------------------------------------------
# The memory model is validated to this (issue 18): |measured / predicted - 1| <= 15% per rank.
MEMORY_RTOL = 0.15


class VerifyError(RuntimeError):
    """A verify run that did not complete: the launcher's command and the workers' output."""


def planned_train(model, train, cuda: bool):
    """The TrainSpec the plan of a --verify run assumes on this machine: transformers' published
    plan gathers the head's logits on every tp rank ('colwise_gather_output'); on the CPU a
    dropout keeps its mask in float32, the worker's dtype (TrainSpec.dropout_mask_bytes), SDPA
    with dropout runs its math path, which keeps the scores as eager attention does, and ZeRO-3's
    buffer pool keeps two gather buffers idle (TrainSpec.pooled_gather_buffers)."""
    import dataclasses

    dropout = model.dropout if train.dropout is None else train.dropout
    return dataclasses.replace(train, vocab_parallel_loss=False, dropout_mask_bytes=1 if cuda else train.act_bytes,
                               pooled_gather_buffers=0 if cuda else 2,
                               flash_attention=train.flash_attention and (cuda or not dropout))


def verify(model, train, config: str, gpus: int, *, top: int = 3, steps: int = 3, gpu_mem_bytes: float | None = None,
           timeout_s: float = 600.0, rows: int = 15) -> dict:
    """Plan for `gpus` local processes and run the top `top` candidates for `steps` steps each
    (module docstring); the report `format_report` prints. Raises VerifyError when the workers
    fail or run past `timeout_s` (then they are killed)."""
    import dataclasses

    import torch

    if steps < 2:
        raise ValueError(f"--verify-steps must be >= 2 (the first step warms up and is not timed), got {steps}")
    if top < 1:
        raise ValueError(f"--verify N runs the N best layouts: N must be >= 1, got {top}")
    attention = "sdpa" if train.flash_attention else "eager"
    train = planned_train(model, train, cuda=torch.cuda.is_available())
    with tempfile.TemporaryDirectory(prefix="plan-verify-") as work:
        job, out = os.path.join(work, "job.json"), os.path.join(work, "out.json")
        with open(job, "w") as f:
            json.dump({"model": dataclasses.asdict(model), "train": dataclasses.asdict(train), "config": config,
                       "attention": attention, "seq": model.seq, "steps": steps,
                       "top": top, "gpu_mem_bytes": gpu_mem_bytes, "timeout_s": timeout_s, "rows": rows}, f)
        cores = os.cpu_count() or 1
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // gpus)),
               "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               "-m", "parallel_layers.plan.verify", "--job", job, "--out", out]
        # A session of its own, so that a timeout kills the launcher and every worker it started.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise VerifyError(f"--verify: the workers ran past --verify-timeout {timeout_s:g} s and were killed "
                              f"({' '.join(cmd)}); output:\n{_tail(output)}") from None
        if proc.returncode != 0 or not os.path.exists(out):
            raise VerifyError(f"--verify: the workers failed (exit code {proc.returncode}; {' '.join(cmd)}):\n"
                              f"{_tail(output)}")
        with open(out) as f:
            return json.load(f)


def _tail(text: str | None, lines: int = 60) -> str:
    return "\n".join((text or "").splitlines()[-lines:])


def compare(report: dict) -> list[dict]:
    """Per run and rank: predicted and measured memory and step time, and their ratios."""
    rows = []
    for run in report["runs"]:
        pred = run["predicted"]
        for rank, m in enumerate(run["measured"]):
            rows.append({"layout": run["layout"], "rank": rank, "predicted_memory": pred["memory"],
                         "measured_memory": m["peak"], "memory_ratio": m["peak"] / pred["memory"],
                         "predicted_step": pred["step_time"], "measured_step": m["step_time"],
                         "step_ratio": m["step_time"] / pred["step_time"]})
    return rows


def format_report(report: dict) -> str:
    MB = 1e6  # as the plan's table
    cal, cluster = report["calibration"], report["cluster"]
    baseline = max(c["baseline"] for c in cal)
    lines = [report["cluster"]["table"], "",
             f"verify: {report['world']} local processes ({report['device']}), measured on this machine: GEMM "
             f"{min(c['gemm_flops'] for c in cal) / 1e9:.1f} GFLOP/s per rank ({report.get('gemm_dtype', 'float32')}, "
             f"all ranks at once; the "
             f"planner's flops at mfu 1), gloo all-reduce {cluster['intra_node_bw'] / 1e9:.2f} GB/s per rank, "
             f"{cluster['gpu_mem_bytes'] / 1e9:.1f} GB per rank for the training state",
             f"memory: the training state the planner predicts (params, grads, optimizer, activations); measured = "
             + ("torch.cuda.max_memory_allocated over the steps minus memory_allocated before the model was built"
                if report["device"] == "cuda" else
                f"peak resident set (VmHWM) over the steps minus the resident set right before the model was built "
                f"({baseline / MB:.0f} MB: interpreter, torch, the process group)"),
             f"step time: median after the first step; predicted from the measured GEMM rate and bandwidth (the "
             f"planner counts GEMMs and collectives only, not elementwise ops or the optimizer)", "",
             f"  {'layout':44s} {'rank':>4s} {'memory MB':>10s} {'measured':>9s} {'ratio':>6s} "
             f"{'step s':>7s} {'measured':>9s} {'ratio':>6s}"]
    rows = compare(report)
    for run in report["runs"]:
        for row in (r for r in rows if r["layout"] == run["layout"]):
            ok = abs(row["memory_ratio"] - 1) <= MEMORY_RTOL
            lines.append(f"  {row['layout']:44s} {row['rank']:4d} {row['predicted_memory'] / MB:10.1f} "
                         f"{row['measured_memory'] / MB:9.1f} {row['memory_ratio']:6.2f} {row['predicted_step']:7.3f} "
                         f"{row['measured_step']:9.3f} {row['step_ratio']:6.2f}"
                         f"{'' if ok else f'  memory off by more than {MEMORY_RTOL:.0%}'}")
        p = {k: v / MB for k, v in run["predicted"].items() if k != "step_time"}
        lines.append(f"    predicted = params {p['params']:.1f} + optimizer {p['optimizer']:.1f} + the larger of "
                     f"(activations {p['activations']:.1f} + loss temporaries {p['loss_temporaries']:.1f} + grads "
                     f"meanwhile {p['grads_at_loss']:.1f}) and grads {p['grads']:.1f} MB")
    lines += [f"  skipped {s}" for s in cluster["skipped"]]
    return "\n".join(lines)


# ---- the worker (one per rank, under torchrun) ---------------------------------------------
def _vm(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _memory_now(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _vm("VmRSS")


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS (Linux >= 4.0)
            f.write("5")


def _peak(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _vm("VmHWM")


def _warm_gemm_libraries(device, dtype) -> None:
    """One tiny forward + backward of the fused ops, so that the state the GEMM libraries keep for
    the process (oneDNN's JIT kernels and pools: ~4.7 MB on the first call on CPU; MKL's is set up by
    the calibration's torch.mm) is in the baseline, not in the measured training state (Note
    [measured peak])."""
    import torch

    from parallel_layers.ops import linear_gelu, linear_swiglu

    x = torch.randn(8, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
    (linear_swiglu(x, w).sum() + linear_gelu(x, w).sum()).backward()


def _gemm_rate(device, dtype, n: int = 512, seconds: float = 0.5) -> float:
    """Achieved matmul flop/s of this rank in `dtype` (n x n x n, repeated for about `seconds`)."""
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _allreduce_bandwidth(device, nbytes: int = 8 * 2**20, reps: int = 5) -> float:
    """Bytes per second each rank moves in a ring all-reduce (2(n-1)/n of the buffer; the
    planner's convention), the median over `reps`. inf at world size 1."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if n == 1:
        return float("inf")
    buf = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(buf)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * (n - 1) / n * nbytes / statistics.median(times)


def _build_model(config_dir: str, attention: str, dtype=None):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)  # every rank builds the same model; parallelize keeps this rank's part
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32,
                                                         attn_implementation=attention)


def _with_lora(model, rank: int):
    """`model` adapted as the planner's LoRA fine-tune assumes (Note [LoRA in the plan] in
    plan/cost.py), as examples/finetune_hf.py's `with_lora` adapts it: peft's LoRA of rank `rank`
    on every linear layer of the decoder, no dropout, the rest frozen."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                      lora_dropout=0.0))


def _save_random_model(config: str, rank: int, directory: str, lora_rank: int | None = None) -> str:
    """Rank 0 writes the model, randomly initialised, as a save_pretrained directory every rank
    then loads its part of (hf.load_pretrained); returns the directory. This also imports
    transformers and the model's code (and with LoRA peft's, adapting a meta copy): imports grow
    the resident set, and belong to the baseline."""
    import torch
    import torch.distributed as dist

    import parallel_layers.parallelize  # noqa: F401
    import parallel_layers.pipeline.hf  # noqa: F401

    if rank == 0:
        _build_model(config, "eager").save_pretrained(directory)
    with torch.device("meta"):
        model = _build_model(config, "eager")
        if lora_rank:
            _with_lora(model, lora_rank)
    del model
    dist.barrier()
    return directory


def _train(config: str, weights: str, attention: str, launch: dict, seq: int, steps: int, ctx, device,
           lora_rank: int | None = None) -> dict:
    """Build (with `lora_rank`: adapted by peft, `_with_lora`), parallelize and train one
    candidate; this rank's measurements."""
    import torch

    from parallel_layers import hf, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    par_kwargs = {**launch["parallelize"], "param_dtype": _dtype(launch["parallelize"]["param_dtype"])}
    model_dtype = _dtype(launch["model_dtype"])
    _warm_gemm_libraries(device, par_kwargs["param_dtype"] or model_dtype)
    gc.collect()
    baseline = _memory_now(device)
    with torch.device("meta"):  # each rank allocates only what it keeps (Note [measured peak])
        model = _build_model(config, attention, model_dtype)
        if lora_rank:  # the adapters on the meta device too: load_pretrained draws peft's initialization
            model = _with_lora(model, lora_rank)
    vocab = model.config.vocab_size
    # a pipeline cuts the transformers model inside peft's wrapper (its LoRA layers with it), as
    # examples/finetune_hf.py does
    target = model.get_base_model() if lora_rank and par_kwargs["pipeline_layers"] else model
    # the model's output, or the last pipeline stage's logits
    loss_fn = lambda out, labels: causal_lm_loss(getattr(out, "logits", out), labels)  # noqa: E731
    par = parallelize(target, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), loss_fn=loss_fn,
                      tp_plan="auto" if ctx.dims.tp > 1 else None,  # ZeRO's units and checkpointed blocks: the defaults
                      **par_kwargs)  # pipeline_layers="auto" with a pipeline
    hf.load_pretrained(weights, par, adapter_seed=0)  # the same adapters on every rank and layout
    del model, target
    gc.collect()
    after_setup = _memory_now(device)
    _reset_peak(device)
    batch = launch["micro_batch"] * par_kwargs["microbatches"]  # this dp rank's sequences per step
    g = torch.Generator().manual_seed(ctx.coordinate("dp"))
    times = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        start = time.perf_counter()
        par.forward_backward(ids, ids)
        par.step()
        par.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = _peak(device)
    del par
    gc.collect()
    return {"peak": peak - baseline, "setup": after_setup - baseline, "baseline": baseline,
            "step_time": statistics.median(times[1:] or times), "step_times": times}


def _worker(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_run_worker)(argv)  # torchrun's summary then carries the failing rank's traceback


def _run_worker(argv: list[str] | None) -> None:
    import torch
    import torch.distributed as dist

    from parallel_layers import init_parallel

    ap = argparse.ArgumentParser(prog="python -m parallel_layers.plan.verify")
    ap.add_argument("--job", required=True, help="what to plan and run (JSON, written by verify())")
    ap.add_argument("--out", required=True, help="rank 0 writes the plan and every rank's measurements here (JSON)")
    args = ap.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    ctx = init_parallel(device=device, timeout_s=job["timeout_s"])
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(mine):
        every = [None] * world
        dist.all_gather_object(every, mine)
        return every

    lora_rank = job["train"].get("lora_rank")
    weights = _save_random_model(job["config"], rank, os.path.join(os.path.dirname(args.out), "model"), lora_rank)
    gc.collect()
    # the GEMMs' dtype: float32, or mixed precision's bfloat16 (the planner's flops are 16-bit)
    gemm_dtype = torch.float32 if job["train"]["precision"] == "fp32" else torch.bfloat16
    calibration = gather({"baseline": _memory_now(device), "gemm_flops": _gemm_rate(device, gemm_dtype),
                          "allreduce_bw": _allreduce_bandwidth(device)})
    chosen = [None]
    if rank == 0:  # one plan, made where the numbers are, broadcast so that every rank runs the same
        try:
            chosen[0] = _choose(job, calibration, device)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            chosen[0] = e
    dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], Exception):
        raise chosen[0]
    cluster, runs = chosen[0]
    if runs:  # Note [a first run's one-time state]
        sub = init_parallel(**runs[0]["launch"]["init_parallel"], device=device, timeout_s=job["timeout_s"])
        _train(job["config"], weights, job["attention"], runs[0]["launch"], job["seq"], 2, sub, device, lora_rank)
    for run in runs:
        sub = init_parallel(**run["launch"]["init_parallel"], device=device, timeout_s=job["timeout_s"])
        run["measured"] = gather(_train(job["config"], weights, job["attention"], run["launch"], job["seq"], job["steps"],
                                        sub, device, lora_rank))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"device": device.type, "world": world, "calibration": calibration, "cluster": cluster,
                       "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
                       "runs": runs}, f)
    ctx.shutdown()


if __name__ == "__main__":
    _worker()
