"""Typed Python wrappers of the custom ops, with their fake and autograd registrations."""

from parallel_layers.ops.bias_gelu import bias_gelu

__all__ = ["bias_gelu"]
