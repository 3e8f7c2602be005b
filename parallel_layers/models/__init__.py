"""Small reference models built from the library's layers (examples, tests, benchmarks)."""

from parallel_layers.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
