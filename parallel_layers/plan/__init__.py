"""Layout planner: which (dp, tp, pp, cp, ZeRO stage, recomputation, microbatches) to train a transformer with.

    python -m parallel_layers.plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 \\
        --gpus 64 --gpus-per-node 8 --gpu-mem 80GB
    python -m parallel_layers.plan --hf-config path/to/model_dir --seq 4096 --gpus 64 --gpus-per-node 8 --gpu h100
    python -m parallel_layers.plan --hf-config small_model/ --seq 128 --gpus 2 --gpus-per-node 2 --verify 2

    best, rejected = recommend(ModelSpec(7e9, 32, 4096, 4096), ClusterSpec(64, 8, parse_size("80GB")))
    best, rejected = recommend(ModelSpec.from_hf_config("model_dir", seq=4096), ClusterSpec.preset("h100", 64))

Every layout with dp * tp * pp * cp = gpus (and each ZeRO stage, virtual pipeline stage count,
recomputation and optimizer offload) is estimated (per-rank memory, communication per step,
pipeline bubble, step time), the rules of docs/parallelism.md ("Composing") pick one, and every
other layout carries the reason it lost, with its numbers. docs/planner.md has the whole model,
its sources, and the published layouts it is checked against (tests/test_plan_published.py).
`--verify N` runs the N best layouts that fit this machine and compares the predicted peak
memory and step time with measured ones (verify.py).

The package, read in this order: `model.py` (the model's shape, from a Hugging Face config
too), `specs.py` (cluster, training settings, a layout and its estimate), `cost.py` (the cost
model: memory, communication, bubble and step time of one layout, with its formulas and
sources), `search.py` (every layout, the rules, the reasons), `cli.py` (the command line and
its table), `verify.py` (`--verify`).
"""

from parallel_layers.plan.cost import (activation_bytes, estimate, lora_layer_params, loss_temporaries, stage_layers,
                                       step_flops)
from parallel_layers.plan.model import GB, HF_FAMILIES, MLP_KINDS, ModelSpec, hf_config_spec, parse_size
from parallel_layers.plan.search import DP_ONLY_SLACK, TIE, candidates, launch_args, reason_kind, recommend
from parallel_layers.plan.specs import GPU_PRESETS, RECOMPUTE, ClusterSpec, Estimate, Layout, TrainSpec
from parallel_layers.plan.cli import format_plan, main

__all__ = ["DP_ONLY_SLACK", "GB", "GPU_PRESETS", "HF_FAMILIES", "MLP_KINDS", "RECOMPUTE", "ClusterSpec", "Estimate", "Layout",
           "ModelSpec", "TrainSpec", "activation_bytes", "candidates", "estimate", "format_plan", "hf_config_spec",
           "launch_args", "lora_layer_params", "loss_temporaries", "main", "parse_size", "reason_kind", "recommend",
           "stage_layers", "step_flops", "TIE"]
