"""`python -m parallel_layers.plan ... --verify` (parallel_layers/plan/verify.py): the planner's top
layouts for 2 local processes run under torchrun (gloo, the composing parallelize) on a tiny
Hugging Face Llama, and each rank's measured peak memory is within 15% of the prediction
(issue 18's acceptance). The memory terms are made large enough to measure above the resident
set's noise: a vocabulary of 8192 (the head's [tokens, vocab] float32 logits and softmax) and
eager attention's [heads, seq, seq] probabilities at seq 128."""

import pytest

from parallel_layers import plan
from parallel_layers.plan import verify as _verify

WORLD = 2


def _save_tiny_llama(directory) -> None:
    import transformers

    transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256,
                             tie_word_embeddings=False).save_pretrained(directory)


def _cli(directory, *extra) -> list[str]:
    return ["--hf-config", str(directory), "--seq", "128", "--gpus", str(WORLD), "--gpus-per-node", str(WORLD),
            "--global-batch", "8", *extra]


def test_verify_runs_the_top_layouts_and_memory_is_within_15_percent(tmp_path, capsys):
    _save_tiny_llama(tmp_path)
    report = plan.main(_cli(tmp_path, "--verify", "2", "--verify-steps", "2", "--verify-timeout", "240"))
    out = capsys.readouterr().out
    assert len(report["runs"]) == 2, "each of the top 2 layouts ran"
    for run in report["runs"]:
        assert len(run["measured"]) == WORLD, f"{run['layout']}: every rank reported"
        assert run["layout"] in out
    rows = _verify.compare(report)
    assert len(rows) == 2 * WORLD
    for row in rows:
        assert row["measured_memory"] > 0 and row["measured_step"] > 0, row
        assert row["memory_ratio"] == pytest.approx(1, abs=_verify.MEMORY_RTOL), (
            f"{row['layout']} rank {row['rank']}: measured {row['measured_memory']} B vs predicted "
            f"{row['predicted_memory']} B")
    assert "VmHWM" in out and "GFLOP/s" in out, "the output says what is measured and how"


def test_verify_runs_a_lora_fine_tune(tmp_path, capsys):
    """--lora R --verify: the worker adapts the model as the plan assumes (peft's LoRA of rank R on
    every linear layer, built on the meta device, filled by hf.load_pretrained), only the adapters
    train, and the measured peak is within 15% of the LoRA estimate. One layout (ZeRO-1, which
    the model names to 2% here); before the LoRA activations were counted (an adapted MLP runs
    unfused; each adapter keeps its [tokens, r]) it measured 1.08 of the estimate, DDP 1.18."""
    pytest.importorskip("peft")
    _save_tiny_llama(tmp_path)
    report = plan.main(_cli(tmp_path, "--lora", "8", "--zero", "1", "--verify", "1", "--verify-steps", "2",
                            "--verify-timeout", "240"))
    assert "LoRA r=8" in capsys.readouterr().out
    (run,) = report["runs"]
    assert run["layout"] == "dp=2 tp=1 pp=1 ZeRO-1 m=1"
    # only the adapters train: their float32 AdamW state, sharded over dp=2, not the model's
    spec = plan.ModelSpec.from_hf_config(str(tmp_path), seq=128)
    assert run["predicted"]["optimizer"] == spec.layers * plan.lora_layer_params(spec, 8) * 8 / WORLD
    for row in _verify.compare(report):
        assert row["memory_ratio"] == pytest.approx(1, abs=_verify.MEMORY_RTOL), row


def test_verify_runs_mixed_precision_through_param_dtype(tmp_path, capsys):
    """--precision mixed --verify (Note [mixed precision in the plan] in plan/cost.py): the model
    built in float32 and trained through ZeRO's param_dtype=bfloat16, the GEMM rate calibrated in
    bfloat16, DataParallel skipped (no float32 masters), and the peak within 15% of the estimate
    at ZeRO-3 with 4 microbatches, whose gradients accumulate in the float32 bank, and at ZeRO-2
    (measured 0.91-0.92 and 1.00; at this size the 15% cannot tell the bank's 4 bytes a
    parameter from the paper's 2: tests/test_plan.py checks that term)."""
    _save_tiny_llama(tmp_path)
    report = plan.main(_cli(tmp_path, "--precision", "mixed", "--zero", "3", "--micro-batch", "1", "--verify", "1",
                            "--verify-steps", "3", "--verify-timeout", "240"))
    out = capsys.readouterr().out
    assert "bfloat16, all ranks at once" in out
    (run,) = report["runs"]
    assert run["layout"] == "dp=2 tp=1 pp=1 ZeRO-3 m=4"
    assert run["launch"]["parallelize"]["param_dtype"] == "bfloat16" and run["launch"]["model_dtype"] == "float32"
    for row in _verify.compare(report):
        assert row["memory_ratio"] == pytest.approx(1, abs=_verify.MEMORY_RTOL), row
    report = plan.main(_cli(tmp_path, "--precision", "mixed", "--zero", "2", "--verify", "1", "--verify-steps", "2",
                            "--verify-timeout", "240"))
    assert "DDP" not in report["runs"][0]["layout"]
    for row in _verify.compare(report):
        assert row["memory_ratio"] == pytest.approx(1, abs=_verify.MEMORY_RTOL), row


def test_verify_skips_mixed_precision_without_zero(tmp_path, capsys):
    _save_tiny_llama(tmp_path)
    with pytest.raises(SystemExit, match="no layout fits this machine and is runnable"):
        plan.main(_cli(tmp_path, "--precision", "mixed", "--zero", "0", "--verify", "1", "--verify-steps", "2",
                       "--verify-timeout", "240"))
    assert "mixed precision at ZeRO-0 (DataParallel holds no float32 masters" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--gpus-per-node", "1"], "--gpus 2 must equal --gpus-per-node 1"),
    (["--gpu", "h100"], "drop ['--gpu']"),
    (["--verify-steps", "1"], "--verify-steps must be >= 2"),
], ids=["two-nodes", "preset", "one-step"])
def test_bad_flag_combinations_name_the_values(tmp_path, capsys, extra, message):
    _save_tiny_llama(tmp_path)
    argv = _cli(tmp_path, "--verify", "2") + extra
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_verify_needs_a_hugging_face_config(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--layers", "4", "--hidden", "256", "--seq", "128", "--gpus", "2", "--gpus-per-node", "2",
                   "--verify"])
    assert "--verify builds the model from a Hugging Face config" in capsys.readouterr().err


def test_workers_past_the_timeout_are_killed_and_reported(tmp_path):
    _save_tiny_llama(tmp_path)
    with pytest.raises(SystemExit, match="ran past --verify-timeout 1 s and were killed"):
        plan.main(_cli(tmp_path, "--verify", "1", "--verify-timeout", "1"))


def test_a_failing_worker_fails_verify_with_its_error(tmp_path):
    """A config the planner reads (it needs only the shape) but transformers cannot build: the
    workers' traceback comes back in the error, and the command exits non-zero."""
    import json

    _save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "no-such-rope", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=r"(?s)the workers failed \(exit code [1-9].*no-such-rope"):
        plan.main(_cli(tmp_path, "--verify", "1", "--verify-timeout", "240"))
