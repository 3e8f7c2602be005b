"""Host memory per rank while `hf.load_pretrained` fills a meta-built model at ZeRO-3, next to the
full model's size and to what plain `from_pretrained` costs one process.

    python benchmarks/bench_load_pretrained.py [--world 4] [--hidden 1024] [--layers 8] [--vocab 32000]

A Llama built from a config (float32, untied head; ~640 MB at the defaults) is saved with
`save_pretrained` into a temporary directory. Then `--world` gloo processes each build it on the
meta device, `parallelize(model, ctx, zero_stage=3)` it over dp = world (ZeRO groups: every
decoder layer, the embedding and the head, so the root group that stays gathered is the final
norm alone), and call `hf.load_pretrained`. Per rank: the peak resident set while loading
minus the resident set just before (the kernel's high-water mark, reset with
/proc/self/clear_refs right before the load), and the anonymous / file-backed split at the
sampled peak (the safetensors files are memory-mapped: pages a rank reads count in its RSS
while the file is open). Baseline, in one process: the same measure around
`AutoModelForCausalLM.from_pretrained(directory)` followed by one forward of 8 tokens - what every
rank pays when each holds the full model (transformers maps the file and reads a weight's pages
when it is first used, so `from_pretrained` alone adds almost nothing). A parity check compares
rank 0's logits for those 8 tokens with that model's.
Writes benchmarks/results/bench_load_pretrained.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # parallel_layers, for the spawned ranks too
from _common import machine, spawn, write_json  # noqa: E402

PROBE = torch.arange(8).unsqueeze(0) * 7 + 3  # 8 token ids, the same in every process


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile"))}


class _PeakSampler:
    """The anonymous / file-backed split of the RSS at its largest sample (every 2 ms)."""

    def __init__(self):
        self.peak, self._stop = _status(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.002):
            s = _status()
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.peak = s

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _measured(load) -> dict:
    """Run `load()`; the peak RSS it added (kernel high-water mark) and the split at the sampled peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status()
    start = time.perf_counter()
    with _PeakSampler() as sampler:
        out = load()
    seconds = time.perf_counter() - start
    after = _status()
    return {"out": out, "seconds": seconds, "peak_added_bytes": after["VmHWM"] - before["VmRSS"],
            "resident_added_after_bytes": after["VmRSS"] - before["VmRSS"],
            "at_sampled_peak_anon_added_bytes": sampler.peak["RssAnon"] - before["RssAnon"],
            "at_sampled_peak_file_added_bytes": sampler.peak["RssFile"] - before["RssFile"]}


def _config(args):
    import transformers

    return transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                    tie_word_embeddings=False)


def _rank(rank, world, directory):
    import torch.nn as nn
    import transformers

    from parallel_layers import hf, init_parallel, parallelize

    ctx = init_parallel(dp=world, device="cpu")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    head = model.get_output_embeddings()
    wrap = lambda m: type(m).__name__.endswith("DecoderLayer") or isinstance(m, nn.Embedding) or m is head  # noqa
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps), loss_fn=lambda out, t: out,
                      zero_stage=3, wrap=wrap)
    result = _measured(lambda: hf.load_pretrained(directory, par))
    result.pop("out")
    result["zero_bytes"] = par.module.memory_bytes()
    with torch.no_grad():
        logits = par.module(PROBE).logits[0, :, :64]
    return result, logits.tolist() if rank == 0 else None


def _baseline(directory):
    import transformers

    def load_and_use():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            return model(PROBE).logits[0, :, :64]

    result = _measured(load_and_use)
    return result, result.pop("out")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    import transformers

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(args))
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(directory)
        del model
        ranks = spawn(_rank, args.world, (directory,))
        baseline, ref_logits = _baseline(directory)
    per_rank = [r[0] for r in ranks]
    diff = (torch.tensor(ranks[0][1]) - ref_logits).abs().max().item()
    worst = max(r["peak_added_bytes"] for r in per_rank)
    mib = 2**20
    print(f"Llama {params / 1e6:.1f}M params, float32: full model {full_bytes / mib:.1f} MiB")
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: peak RSS added while loading {r['peak_added_bytes'] / mib:7.1f} MiB "
              f"({r['peak_added_bytes'] / full_bytes:.2f} of the model; at the sampled peak "
              f"{r['at_sampled_peak_anon_added_bytes'] / mib:.1f} anonymous + "
              f"{r['at_sampled_peak_file_added_bytes'] / mib:.1f} file-backed), resident after "
              f"{r['resident_added_after_bytes'] / mib:.1f} MiB, {r['seconds']:.2f} s")
    print(f"one process, from_pretrained + one forward: peak RSS added {baseline['peak_added_bytes'] / mib:.1f} MiB "
          f"({baseline['peak_added_bytes'] / full_bytes:.2f} of the model), {baseline['seconds']:.2f} s")
    print(f"ZeRO-3 at world {args.world}: worst rank {worst / mib:.1f} MiB = {worst / full_bytes:.2f} x the full "
          f"model ({full_bytes / mib:.0f} MiB); parity with from_pretrained: max |logit diff| {diff:.2e}")
    path = write_json("bench_load_pretrained", {
        "benchmark": "load_pretrained", "machine": machine(), "args": vars(args), "params": params,
        "full_model_bytes": full_bytes, "per_rank": per_rank, "from_pretrained_and_forward_one_process": baseline,
        "worst_rank_peak_added_over_full": worst / full_bytes, "max_abs_logit_diff": diff})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
