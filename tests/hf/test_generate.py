"""generate() on the model a user trained, at the layouts that keep the whole model on every
rank, against plain transformers trained the same way in one process: the greedy tokens and the
scores of every generated position. Under sequence parallelism a decoding step feeds one
position, which cannot split over tp: a forward without gradients whose sequence does not
divide runs as plain tensor parallelism (Note [a forward without the sequence split] in
tensor_parallel/comm.py); a prompt that divides runs its prefill split. Under a pipeline each
rank holds its stages only, and the model called whole there computed on meta placeholders,
silently (Note [a module another rank holds] in pipeline/stages.py): refused on every rank."""

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.hf import _tiny

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, NEW = 2, 4, 16, 6


def _prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (2, n), generator=g) for n in (5, 4)]  # odd, and divisible by tp=2


def _greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences.tolist(), torch.stack(out.scores).tolist()  # plain values: they cross processes


def _parallel(rank, world, directory, layout, vocab):
    from parallel_layers import init_parallel, parallelize
    from parallel_layers.pipeline.hf import causal_lm_loss

    tp = 2 if layout.startswith("tp2") else 1
    pp = 2 if layout.startswith("pp2") else 1
    ctx = init_parallel(tp=tp, pp=pp, dp=world // (tp * pp), device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    par = parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=causal_lm_loss,
                      tp_plan="auto" if tp > 1 else None, sequence_parallel=layout.endswith("-sp"),
                      zero_stage=int(layout[-1]) if "zero" in layout else 0,
                      pipeline_layers="auto" if pp > 1 else None)
    _tiny.parallel_losses(par, ctx, _tiny.token_batches(STEPS, BATCH, SEQ, vocab))
    model.eval()
    if pp > 1:
        refusals = []
        for call in (lambda: _greedy(model, _prompts(vocab)[0]), lambda: model(_prompts(vocab)[0])):
            try:
                call()
            except RuntimeError as e:
                refusals.append(str(e))
            else:
                refusals.append("ran")
        return refusals
    return [_greedy(model, prompt) for prompt in _prompts(vocab)]


def _plain(directory, vocab):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _tiny.plain_losses(model, opt, _tiny.token_batches(STEPS, BATCH, SEQ, vocab))
    model.eval()
    return [_greedy(model, prompt) for prompt in _prompts(vocab)]


@pytest.mark.parametrize("family,layout", [("llama", "tp2"), ("llama", "tp2-sp"), ("gpt2", "tp2-sp"),
                                           ("llama", "dp2-zero3"), ("llama", "dp2-zero1"),
                                           ("qwen2", "dp2-zero0")])
def test_generate_after_training_matches_plain(tmp_path, family, layout):
    getattr(_tiny, f"save_tiny_{family}")(tmp_path)
    vocab = transformers.AutoConfig.from_pretrained(tmp_path).vocab_size
    expected = _plain(tmp_path, vocab)
    for rank, got in enumerate(run_distributed(_parallel, 2, args=(str(tmp_path), layout, vocab))):
        for (tokens, scores), (want_tokens, want_scores) in zip(got, expected):
            assert tokens == want_tokens, (rank, tokens, want_tokens)
            scores, want_scores = torch.tensor(scores), torch.tensor(want_scores)
            assert torch.allclose(scores, want_scores, atol=1e-5), (rank, (scores - want_scores).abs().max())


def test_the_whole_model_on_a_pipeline_rank_is_refused_on_every_rank(tmp_path):
    _tiny.save_tiny_llama(tmp_path)
    got = run_distributed(_parallel, 2, args=(str(tmp_path), "pp2", 128))
    # the stage's layers named as in the model (helper-67: "pipeline layers 0-1" read as holding
    # model.layers.1, which is pipeline layer 2: layer 0 is the embedding)
    first = ("model.layers.1.input_layernorm (FusedRMSNorm) belongs to another pipeline rank's stage: pipeline "
             "rank 0 of 2 holds stage 0 (pipeline layers 0-1: the embedding, model.layers.0) of the 2 stages over 4 "
             "pipeline layers")
    second = ("model.embed_tokens (Embedding) belongs to another pipeline rank's stage: pipeline rank 1 of 2 holds "
              "stage 1 (pipeline layers 2-3: model.layers.1, the final norm and head)")
    for rank, expected in enumerate((first, second)):
        for message in got[rank]:  # generate(), then a plain forward
            assert message.startswith(expected), (rank, message)
            assert "hf.save_pretrained(par, directory)" in message and "pp=1" in message, message
