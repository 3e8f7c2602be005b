"""What the fused kernels buy on one device: a Hugging Face Llama training step, plain vs fused.

    python benchmarks/bench_fused_hf.py [--device cpu|cuda] [--hidden 512 1024] [--layers 4]
                                        [--dtypes float32 bfloat16] [--batch 1 --seq 256] [--reps 10]

The model is bench_hf.py's (a transformers LlamaConfig: grouped-query attention, SwiGLU MLP,
--layers decoder layers, vocabulary --vocab), saved with `save_pretrained` and loaded back with
`from_pretrained` in --dtype for every variant, so that the only difference is the modules:

  plain        the model as transformers builds it
  fused        `parallel_layers.fused.fuse(model)`, what `parallelize` does with fused_kernels=True:
               SwiGLUMLP (one packed GEMM, SiLU-product epilogue), FusedRMSNorm, and the attention's
               residual add inside the post-attention norm (Note [fused residual add])
  fused_no_add the same model with the decoder layers' own forward: the residual add apart

A step is forward + Hugging Face's causal-LM loss + backward + AdamW step + zero_grad on one
[--batch, --seq] batch, the same ids for every variant, timed round-robin in one process, each
round in a shuffled order (_common.time_interleaved; on CUDA synchronised around each step). Ratios (> 1: the second
faster): plain / fused (the fused kernels together), fused_no_add / fused (the residual add's
share). No target: the issue's targets are those of bench_hf.py against the other stacks; this
one says where the fused kernels' part of them comes from. Writes
benchmarks/results/bench_fused_hf.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, time_interleaved, write_json  # noqa: E402
from bench_hf import llama_config  # noqa: E402

import parallel_layers  # noqa: E402
from parallel_layers import fused  # noqa: E402
from parallel_layers.pipeline.hf import causal_lm_loss  # noqa: E402

VARIANTS = ("plain", "fused", "fused_no_add")


def _model(kind: str, model_dir: str, dtype: torch.dtype, device: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if kind == "fused":
        fused.fuse(model)  # after the move: SwiGLUMLP packs gate and up in one allocation on the device
    return model


def _steps(model_dir: str, dtype: torch.dtype, device: str, ids) -> dict:
    """{variant: step function}. fused and fused_no_add share one model and optimizer, each step
    first setting the layers' forward (an attribute: nanoseconds): two model instances differed
    by up to 3% in either direction at the smallest size on CPU (where each one's tensors landed),
    as much as the residual add is worth there."""
    plain, model = _model("plain", model_dir, dtype, device), _model("fused", model_dir, dtype, device)
    forwards = {layer: vars(layer)["forward"] for layer in model.model.layers}  # fuse's instance forwards

    def step_of(net, opt, residual_fused=None):
        def step():
            if residual_fused is not None:
                for layer, forward in forwards.items():
                    if residual_fused:
                        layer.forward = forward
                    else:
                        vars(layer).pop("forward", None)  # the class's forward again
            causal_lm_loss(net(input_ids=ids).logits, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {"plain": step_of(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4)),
            "fused": step_of(model, opt, True), "fused_no_add": step_of(model, opt, False)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--name", default="bench_fused_hf", help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    rows = []
    print(f"{'hidden':>6} {'dtype':>9} | ms/step: {'plain':>8} {'fused':>8} {'no add':>8} | plain/fused, "
          "no_add/fused")
    for hidden in args.hidden:
        with tempfile.TemporaryDirectory() as model_dir:
            torch.manual_seed(0)
            import transformers

            transformers.LlamaForCausalLM(llama_config(hidden, args.layers, args.vocab, args.seq)).save_pretrained(
                model_dir)
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
            ids = ids.to(args.device)
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                steps = _steps(model_dir, dtype, args.device, ids)
                t = time_interleaved(steps, args.reps, sync=sync, shuffle=True)
                ms = {kind: v * 1e3 for kind, v in t.items()}
                ratios = {"plain_over_fused": t["plain"] / t["fused"],
                          "no_add_over_fused": t["fused_no_add"] / t["fused"]}
                rows.append({"hidden": hidden, "dtype": dtype_name, "device": args.device, "ms": ms, "ratios": ratios})
                print(f"{hidden:>6} {dtype_name:>9} | {'':>9}{ms['plain']:8.2f} {ms['fused']:8.2f} "
                      f"{ms['fused_no_add']:8.2f} | {ratios['plain_over_fused']:.3f}, "
                      f"{ratios['no_add_over_fused']:.3f}", flush=True)
                del steps
    payload = {"benchmark": "fused_hf", "machine": machine(), "build": parallel_layers.build_info(),
               "args": vars(args), "rows": rows}
    print(f"wrote {write_json(args.name, payload)}")
    return rows


if __name__ == "__main__":
    main()
