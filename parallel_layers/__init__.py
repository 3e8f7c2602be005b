"""parallel_layers: tensor, pipeline and sharded data parallelism for PyTorch, with fused kernels.

Importing the package loads the compiled extension (parallel_layers._C), which registers the
ops under torch.ops.parallel_layers; their Python wrappers live in parallel_layers.ops.
"""

from parallel_layers import _extension

_C = _extension.load()

from parallel_layers import ops  # noqa: E402  (needs the ops registered by _C)
from parallel_layers.data_parallel import DataParallel  # noqa: E402
from parallel_layers._loss_scale import LossScale  # noqa: E402
from parallel_layers.grad_norm import clip_grad_norm_  # noqa: E402
from parallel_layers.parallel_dims import ParallelContext, ParallelDims, init_parallel, shutdown  # noqa: E402
from parallel_layers.parallelize import Parallelized, parallelize  # noqa: E402
from parallel_layers.pipeline import PipelineParallel, PipelineStages  # noqa: E402
from parallel_layers.tensor_parallel import Column, ColumnParallelLinear, Row, RowParallelLinear  # noqa: E402
from parallel_layers.zero import ZeRO  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Column", "ColumnParallelLinear", "DataParallel", "LossScale", "ParallelContext", "ParallelDims", "Parallelized",
           "PipelineParallel", "PipelineStages", "Row", "RowParallelLinear", "ZeRO", "build_info", "clip_grad_norm_",
           "init_parallel", "ops", "parallelize", "shutdown"]


def build_info() -> dict:
    """What the extension was compiled with: CUDA kernels and archs, torch and CUDA versions."""
    return dict(_C.build_info())
