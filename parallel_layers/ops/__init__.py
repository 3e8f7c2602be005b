"""Typed Python wrappers of the custom ops, with their fake and autograd registrations."""

from parallel_layers.ops import shard_copy
from parallel_layers.ops.bias_gelu import bias_gelu, bias_gelu_backward
from parallel_layers.ops.linear_gelu import (linear_autocast_inputs, linear_gelu, linear_gelu_forward,
                                             linear_forward, linear_input_grad, linear_weight_grad)
from parallel_layers.ops.linear_swiglu import linear_swiglu, linear_swiglu_forward, swiglu_backward
from parallel_layers.ops.rms_norm import FusedRMSNorm, rms_norm, rms_norm_add, rms_norm_backward
from parallel_layers.ops.transpose import transpose_2d

__all__ = ["FusedRMSNorm", "bias_gelu", "bias_gelu_backward", "linear_autocast_inputs", "linear_gelu",
           "linear_forward", "linear_gelu_forward", "linear_input_grad", "linear_swiglu", "linear_swiglu_forward", "linear_weight_grad",
           "rms_norm",
           "rms_norm_add", "rms_norm_backward", "shard_copy", "swiglu_backward", "transpose_2d"]
