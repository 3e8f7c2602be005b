"""Small reference models, single-device code with their tensor-parallel plans (examples, tests, benchmarks)."""

from parallel_layers.models.gpt import GPT, GPT_TP_PLAN, Block, GPTConfig

__all__ = ["GPT", "GPT_TP_PLAN", "Block", "GPTConfig"]
