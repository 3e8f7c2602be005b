"""Tiny Hugging Face models built from configs and saved with save_pretrained: the
"pretrained checkpoints" of the tests (nothing is downloaded)."""

import torch


def save_tiny_llama(directory, tie_word_embeddings: bool = False) -> None:
    """A 2-layer Llama with grouped-query attention (4 heads, 2 key/value heads), untied head
    (or tied to the input embedding)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def save_tiny_gpt2(directory) -> None:
    """A 2-layer GPT-2 (fused QKV in Conv1D layers, weights [in, out]; head tied), no dropout."""
    import transformers

    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)


def save_tiny_qwen2(directory) -> None:
    """A 2-layer Qwen2: grouped-query attention (4 heads, 2 key/value heads), biases on q, k, v."""
    import transformers

    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)


def save_tiny_mistral(directory) -> None:
    """A 2-layer Mistral with grouped-query attention (4 heads, 1 key/value head), rope_theta 1e6."""
    import transformers

    config = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, vocab_size=128,
                                        max_position_embeddings=64,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(directory)


def save_tiny_qwen3(directory) -> None:
    """A 2-layer Qwen3: grouped-query attention (4 heads of 8, 2 key/value heads) with per-head
    RMSNorms on q and k (`q_norm` / `k_norm`, which its published plan sums over tp)."""
    import transformers

    config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)


def save_tiny_gpt_neox(directory) -> None:
    """A 2-layer GPT-NeoX: its head is `lm_head` in the model and `embed_out` in the files
    (transformers renames it at load and back at save)."""
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                                        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(directory)


def save_tiny_mixtral(directory) -> None:
    """A 2-layer Mixtral (4 experts, 2 per token): the files hold one tensor per expert, the
    model one stacked tensor for all of them."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(directory)


def save_tiny_qwen3_moe(directory) -> None:
    """A 2-layer Qwen3-MoE (4 experts, 2 per token; per-head q / k norms): one tensor per expert's
    gate, up and down projection in the files, stacked in the model."""
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                                         max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)


def save_tiny_gemma(directory, tie_word_embeddings: bool = True) -> None:
    """A 2-layer Gemma: its embedding module scales the rows by sqrt(hidden) in its own forward
    (an nn.Embedding subclass); the head tied to it (Gemma's default) or not."""
    import transformers

    config = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    transformers.GemmaForCausalLM(config).save_pretrained(directory)


def save_tiny_phi3(directory) -> None:
    """A 2-layer Phi-3: q, k, v packed in one `qkv_proj` and gate, up in one `gate_up_proj` (in the
    model and in the files), a sliding window of 4 tokens."""
    import transformers

    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                     max_position_embeddings=64, sliding_window=4, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(directory)


def train_losses(model, optimizer, steps: int, vocab: int, low: int = 0) -> list[float]:
    """The losses of `steps` steps of `optimizer` on the causal-LM loss of fixed random token
    ids in [low, vocab) (the same ids for every model)."""
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(low, vocab, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def token_batches(steps: int, batch: int, seq: int, vocab: int) -> list:
    """`steps` batches of random token ids [batch, seq] in [0, vocab), the same on every call."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def probe_ids(seq: int, vocab: int):
    """Two sequences no training step uses, the same on every call."""
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(2))


def next_token_loss(out, ids):
    """Next-token cross-entropy of a causal LM's output on `ids`, as transformers' causal-LM loss
    computes it (float32 logits)."""
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def parallel_losses(par, ctx, batches) -> list[float]:
    """`par.forward_backward`, `step` and `zero_grad` over `batches` of token ids [batch, seq],
    each split over the data-parallel replicas (this rank's share); each step's returned loss."""
    dp_rank, dp = ctx.coordinate("dp"), ctx.dims.dp
    losses = []
    for ids in batches:
        mine = ids.chunk(dp)[dp_rank]
        losses.append(par.forward_backward(mine, mine).item())
        par.step()
        par.zero_grad()
    return losses


def plain_losses(model, optimizer, batches) -> list[float]:
    """The same steps in one process: the next-token loss of each whole batch, backward, step."""
    losses = []
    for ids in batches:
        loss = next_token_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_tiny_tokenizer(directory, vocab: int = 128) -> None:
    """A word-level tokenizer of `vocab` tokens ("t0" ... ), saved with save_pretrained beside a
    tiny model: built here from the `tokenizers` library, nothing downloaded."""
    import tokenizers
    import transformers

    words = {f"t{i}": i for i in range(vocab - 1)} | {"<unk>": vocab - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(directory)
