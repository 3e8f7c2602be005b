"""What else a plan needs besides the model: the cluster (`ClusterSpec`, `GPU_PRESETS`), the
training settings (`TrainSpec`), one layout (`Layout`) and its estimate (`Estimate`)."""

from __future__ import annotations

import dataclasses

from parallel_layers.plan.model import GB

_PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes per parameter: param, grad, optimizer
_REDUCE_BYTES = 4  # ZeRO's reduce-scatter buffers: float32 (its default reduce_dtype)
RECOMPUTE = ("none", "selective", "full")

# Datasheet numbers (not measurements): dense 16-bit peak, memory, and per-GPU, per-direction
# bandwidths: NVLink (A100 600 GB/s, H100/H200 900 GB/s both directions) and one InfiniBand NIC
# per GPU (DGX A100: HDR 200 Gb/s; DGX H100: NDR 400 Gb/s).
GPU_PRESETS = {
    "a100-40gb": dict(gpu_mem_bytes=40 * GB, flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    "a100-80gb": dict(gpu_mem_bytes=80 * GB, flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9),
    "h100": dict(gpu_mem_bytes=80 * GB, flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9),
    "h200": dict(gpu_mem_bytes=141 * GB, flops=989e12, intra_node_bw=450e9, inter_node_bw=50e9),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    gpu_mem_bytes: float
    flops: float = 989e12  # per GPU, dense bf16 (H100 SXM)
    intra_node_bw: float = 450e9  # bytes/s per GPU (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per GPU (400 Gb/s InfiniBand)
    mfu: float = 0.5  # fraction of `flops` the GEMMs reach: an assumption, not a measurement
    pcie_bw: float = 25e9  # bytes/s per GPU to host memory (PCIe 4 x16), for optimizer offload
    host_mem_bytes: float = 1e12  # per node, for optimizer offload
    cpu_adam_params_per_s: float = 1e9  # per GPU's share of the host's cores: an assumption

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % min(self.gpus, self.gpus_per_node):
            raise ValueError(f"gpus ({self.gpus}) must be a positive multiple of gpus_per_node "
                             f"({self.gpus_per_node}) or fewer than it")
        for name in ("gpu_mem_bytes", "flops", "intra_node_bw", "inter_node_bw", "pcie_bw", "host_mem_bytes",
                     "cpu_adam_params_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClusterSpec.{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"ClusterSpec.mfu must be in (0, 1], got {self.mfu!r}")

    @classmethod
    def preset(cls, gpu: str, gpus: int, gpus_per_node: int = 8, **overrides) -> ClusterSpec:
        """A cluster of one of GPU_PRESETS' GPUs (datasheet peak, memory, NVLink and NIC bandwidths)."""
        if gpu not in GPU_PRESETS:
            raise ValueError(f"unknown GPU {gpu!r}; presets: {sorted(GPU_PRESETS)} (or give --gpu-mem, --tflops, "
                             "--intra-node-bw, --inter-node-bw)")
        return cls(gpus, gpus_per_node, **{**GPU_PRESETS[gpu], **overrides})


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    global_batch: int = 512  # sequences per optimizer step
    precision: str = "mixed"  # "mixed" (bf16 params/grads/activations, fp32 Adam) or "fp32"
    dropout: bool | None = None  # None: the model's own (ModelSpec.dropout)
    flash_attention: bool = False  # False: eager attention keeps the s x s scores (Megatron's formula)
    sequence_parallel: bool = True  # with tp > 1: norms and dropout split over tp too (same traffic as TP's)
    recompute: str | tuple[str, ...] = "auto"  # "none", "selective", "full"; "auto" or a tuple: the least that fits
    optimizer_offload: bool | None = None  # None: only when nothing fits on the GPU; needs ZeRO >= 1
    micro_batch: int | None = None  # sequences per microbatch; None: searched
    virtual_stages: int | None = None  # interleaved pipeline chunks per rank; None: searched (1, 2, 4)
    context_parallel: int | None = 1  # None: searched; > 1 is modelled only (parallel_layers lacks it)
    zero: int | None = None  # None: searched (0-3)
    tensor_parallel: int | None = None  # None: searched; fixed to compare with a system that had one
    pipeline_parallel: int | None = None  # None: searched (e.g. 1 for a system without pipelines)
    vocab_parallel_loss: bool = True  # False: the head's logits are gathered to the whole vocab on every tp rank
    # bytes a dropout keeps per element for backward: 1 on a GPU (its fused dropout keeps a bool
    # mask); the CPU's keeps the scaled mask in the input's dtype (ATen's unfused dropout)
    dropout_mask_bytes: int = 1
    # parallelize's fused_kernels (its default True): a dense SwiGLU MLP as `linear_swiglu` keeps 3
    # ffn-wide tensors a token for backward, the unfused MLP (and a mixture's experts) 4
    fused_kernels: bool = True
    # a stage's layers' gather buffers that ZeRO-3 keeps idle through the step's peak, a layer's
    # params each: 0 on a GPU (the caching allocator's reuse is not allocated memory); on the CPU
    # its buffer pool keeps the two the next gathers take (Note [CPU buffer reuse] in zero/_group.py)
    pooled_gather_buffers: int = 0
    # a mixture of experts' experts over groups of ep dp ranks: True (ep = dp), False, a number ep,
    # or None: searched (without, and every ep dividing both dp and the expert count)
    expert_parallel: bool | int | None = None
    # a LoRA fine-tune (peft's target_modules="all-linear"): adapters of this rank on every linear
    # layer of the decoder layers - attention's q, k, v, o and a dense MLP's -, everything else
    # frozen (Note [LoRA in the plan] in cost.py); None: every parameter trains
    lora_rank: int | None = None
    # attention takes the softmax of 16-bit scores in float32 and keeps it for backward, as
    # transformers' eager attention does (Megatron's fused softmax: False)
    float32_softmax: bool = False

    def __post_init__(self):
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {list(_PRECISIONS)}, got {self.precision!r}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")
        modes = self.recompute if isinstance(self.recompute, tuple) else (self.recompute,)
        if not modes or any(mode not in RECOMPUTE for mode in modes) and modes != ("auto",):
            raise ValueError(f"recompute must be one of {[*RECOMPUTE, 'auto']} or a tuple of {list(RECOMPUTE)} "
                             f"(those the training system has), got {self.recompute!r}")
        for name in ("micro_batch", "virtual_stages", "context_parallel", "tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None (searched), got {value!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2, 3 or None (searched), got {self.zero!r}")
        if not (self.expert_parallel is None or isinstance(self.expert_parallel, bool)
                or isinstance(self.expert_parallel, int) and self.expert_parallel >= 1):
            raise ValueError(f"expert_parallel must be True, False, a positive integer (the data-parallel ranks "
                             f"each MoE layer's experts are spread over) or None (searched), got "
                             f"{self.expert_parallel!r}")
        if self.optimizer_offload and self.zero == 0:
            raise ValueError("optimizer_offload=True needs ZeRO >= 1 (ZeRO-Offload moves the optimizer shard), "
                             "got zero=0")
        for name in ("dropout_mask_bytes", "pooled_gather_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int)
                                           or self.lora_rank < 1):
            raise ValueError(f"lora_rank must be a positive integer (the adapters' rank r) or None (every parameter "
                             f"trains), got {self.lora_rank!r}")
        if not isinstance(self.fused_kernels, bool):
            raise ValueError(f"fused_kernels must be True or False (parallelize's), got {self.fused_kernels!r}")
        if not isinstance(self.float32_softmax, bool):
            raise ValueError(f"float32_softmax must be True (attention keeps a float32 softmax of 16-bit scores, as "
                             f"transformers' eager attention) or False, got {self.float32_softmax!r}")

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
    cp: int = 1  # context parallel: each sequence's tokens split over cp ranks
    virtual: int = 1  # interleaved pipeline: chunks per rank
    recompute: str = "none"
    offload: bool = False  # optimizer state in host memory
    ep: int = 1  # a mixture of experts' experts spread over groups of ep dp ranks (expert_parallel); 1: none

    def __post_init__(self):
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"Layout.ep is the number of data-parallel ranks the experts are spread over, a divisor "
                             f"of dp={self.dp} (1: no expert parallelism), got {self.ep!r}")

    def __str__(self) -> str:
        z = f"ZeRO-{self.zero}" if self.zero else ("DDP" if self.dp * self.cp > 1 else "-")
        text = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        text += f" cp={self.cp}" if self.cp > 1 else ""
        text += f" ep={self.ep}" if self.ep > 1 else ""
        text += f" v={self.virtual}" if self.virtual > 1 else ""
        text += f" {z}{'+offload' if self.offload else ''} m={self.microbatches}"
        return text + (f" rc={self.recompute}" if self.recompute != "none" else "")


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
    flops: float = 0.0  # hardware flops per step, all GPUs (recomputation included)
    host: float = 0.0  # host bytes per GPU (offloaded optimizer)
    modelled_only: str | None = None  # what of this layout parallel_layers cannot run yet
    loss_temporaries: float = 0.0  # the loss's float32 logits copies beyond the one kept for backward
    grads_at_loss: float = 0.0  # gradient bytes alive while the activations are (see `memory`)

    @property
    def memory(self) -> float:
        """Peak bytes per rank (Note [peak memory] in cost.py)."""
        return (self.params + self.optimizer
                + max(self.activations + self.loss_temporaries + self.grads_at_loss, self.grads))

    def tflops_per_gpu(self, gpus: int) -> float:
        """Achieved hardware TFLOP/s per GPU (as Megatron reports it: recomputation counted)."""
        return self.flops / (gpus * self.step_time) / 1e12


