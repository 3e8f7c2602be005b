"""Tiny Hugging Face models built from configs and saved with save_pretrained: the
"pretrained checkpoints" of the tests (nothing is downloaded)."""

import torch


def save_tiny_llama(directory) -> None:
    """A 2-layer Llama with grouped-query attention (4 heads, 2 key/value heads), untied head."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
