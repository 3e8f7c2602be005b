"""Typed Python wrappers of the custom ops, with their fake and autograd registrations."""

from parallel_layers.ops import shard_copy
from parallel_layers.ops.bias_gelu import bias_gelu
from parallel_layers.ops.linear_gelu import linear_gelu
from parallel_layers.ops.transpose import transpose_2d

__all__ = ["bias_gelu", "linear_gelu", "shard_copy", "transpose_2d"]
