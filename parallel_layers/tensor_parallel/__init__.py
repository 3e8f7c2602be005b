"""Tensor parallelism: communication (comm), parameter sharding (sharding), layers (layers),
plans that convert an existing model's layers (plan: `parallelize(model, plan, tp_group=...)`)."""

from parallel_layers.tensor_parallel.comm import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from parallel_layers.tensor_parallel.experts import Experts
from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, reduce_grad_over_tp
from parallel_layers.tensor_parallel.plan import Column, Replicated, Row, VocabParallel, parallelize, published_plan
from parallel_layers.tensor_parallel.sharding import TPShard, gather_full
from parallel_layers.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    tied_cross_entropy,
    tied_logits,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)

__all__ = [
    "Column", "ColumnParallelLinear", "Experts", "Row", "RowParallelLinear", "TPShard", "copy_to_tp", "gather_from_sp",
    "gather_from_tp", "gather_full", "parallelize", "published_plan", "reduce_from_tp", "reduce_grad_over_tp",
    "Replicated", "reduce_scatter_to_sp", "scatter_to_sp", "scatter_to_tp", "tied_cross_entropy", "tied_logits", "VocabParallel",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "vocab_parallel_logits",
]
