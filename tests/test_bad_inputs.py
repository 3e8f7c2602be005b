"""Bad inputs across the public API: every error names the offending value and what is valid.

docs/errors.md lists every bad input counted for issue 8 with the test that checks its message;
this file holds those no other test covers. CASES is the single-process table (one row per bad
input: the call, the exception type, the key part of its message); the `*_on_every_rank` tests
run on 2 gloo processes, where an error must reach every rank instead of leaving one waiting.
"""

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers import (Column, ColumnParallelLinear, DataParallel, ParallelDims, PipelineParallel,
                             PipelineStages, RowParallelLinear, ZeRO, checkpoint, clip_grad_norm_, init_parallel, ops)
from parallel_layers.ops import shard_copy
from parallel_layers.pipeline.schedule import build_schedule
from parallel_layers.plan import ClusterSpec, ModelSpec, TrainSpec
from parallel_layers.tensor_parallel import VocabParallelEmbedding, parallelize, vocab_parallel_cross_entropy
from parallel_layers.zero import ShardedParam
from tests.dist_harness import run_distributed

_ops = torch.ops.parallel_layers
_CONTIGUOUS_BUFFER = "buffer ([world_size, sum of shard sizes]), got shape"


def _ce(target, **kwargs):
    return vocab_parallel_cross_entropy(torch.randn(*target.shape, 10), target, VocabParallelEmbedding(10, 4),
                                        **kwargs)


def _pipe(**kwargs):
    kwargs = {"microbatches": 2, "loss_fn": nn.functional.mse_loss, **kwargs}
    return PipelineParallel(PipelineStages([nn.Linear(2, 2)]), **kwargs)


CASES = [
    # ---- ops (C++ TORCH_CHECK messages, csrc/) ------------------------------------------------------------------
    pytest.param(lambda: ops.linear_gelu(torch.ones(2, 3, dtype=torch.int32), torch.ones(4, 3, dtype=torch.int32)),
                 RuntimeError, "x must be float32, float64, float16 or bfloat16, got Int", id="linear_gelu-int-dtype"),
    pytest.param(lambda: ops.linear_gelu(torch.tensor(1.0), torch.randn(4, 3)),
                 RuntimeError, "x must have at least 1 dimension, got shape []", id="linear_gelu-0d-x"),
    pytest.param(lambda: ops.linear_gelu(torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, dtype=torch.float64)),
                 RuntimeError, "x has dtype Float but bias has dtype Double; they must match",
                 id="linear_gelu-bias-dtype"),
    pytest.param(lambda: _ops.bias_gelu_backward(torch.tensor(1.0), torch.tensor(1.0), "none"),
                 RuntimeError, "preact must have at least 1 dimension, got shape []", id="bias_gelu_backward-0d"),
    pytest.param(lambda: _ops.bias_gelu_backward(torch.randn(2, 3), torch.randn(2, 3), "erf"),
                 RuntimeError, "approximate must be 'none' or 'tanh', got 'erf'", id="bias_gelu_backward-approximate"),
    pytest.param(lambda: _ops.all_gather_copy_in([torch.randn(2)], torch.empty(2, 4)[:, :2], 0),
                 RuntimeError, f"out must be a contiguous [2, 2] {_CONTIGUOUS_BUFFER} [2, 2] strides [4, 1]",
                 id="all_gather_copy_in-strided-out"),
    pytest.param(lambda: shard_copy.all_gather_copy_in([torch.ones(2, dtype=torch.int64)], 2, 0, torch.float32),
                 RuntimeError, "shards must be float32, float64, float16 or bfloat16, got Long",
                 id="all_gather_copy_in-int-shards"),
    pytest.param(lambda: shard_copy.all_gather_copy_in([torch.randn(2)], 0, 0, torch.float32),
                 ValueError, "world_size must be a positive integer, got 0", id="all_gather_copy_in-world-0"),
    pytest.param(lambda: shard_copy.all_gather_copy_out(torch.empty(4), [torch.empty(2)]),
                 RuntimeError, "gathered must be [world_size, sum of shard sizes], got shape [4]",
                 id="all_gather_copy_out-1d"),
    pytest.param(lambda: shard_copy.all_gather_copy_out(torch.empty(2, 3), [torch.empty(2)]),
                 RuntimeError, f"gathered must be a contiguous [2, 1] {_CONTIGUOUS_BUFFER} [2, 3]",
                 id="all_gather_copy_out-wrong-size"),
    pytest.param(lambda: _ops.reduce_scatter_copy_in([torch.randn(4)], torch.empty(2, 3), 1.0),
                 RuntimeError, f"out must be a contiguous [2, 2] {_CONTIGUOUS_BUFFER} [2, 3]",
                 id="reduce_scatter_copy_in-out-shape"),
    pytest.param(lambda: shard_copy.reduce_scatter_copy_in([torch.randn(4), torch.randn(4, dtype=torch.float64)], 2,
                                                           torch.float32),
                 RuntimeError, "all grads must have one dtype: grads[0] is Float but grads[1] is Double",
                 id="reduce_scatter_copy_in-mixed-dtypes"),
    pytest.param(lambda: shard_copy.reduce_scatter_copy_in([torch.randn(4)], 0, torch.float32),
                 ValueError, "world_size must be a positive integer, got 0", id="reduce_scatter_copy_in-world-0"),
    pytest.param(lambda: shard_copy.reduce_scatter_copy_out(torch.empty(3), [torch.empty(3, dtype=torch.float64),
                                                                             torch.empty(0)]),
                 RuntimeError, "all shard_grads must have one dtype: shard_grads[0] is Double but shard_grads[1] is "
                 "Float", id="reduce_scatter_copy_out-mixed-dtypes"),
    # ---- ParallelDims ----------------------------------------------------------------------------------------------
    pytest.param(lambda: ParallelDims(dp=1, tp=1, pp=1, world_size=0),
                 ValueError, "world_size must be a positive integer, got 0", id="ParallelDims-world-0"),
    pytest.param(lambda: ParallelDims(dp="2", tp=1, pp=1, world_size=2),
                 ValueError, "dp must be a positive integer, got '2'", id="ParallelDims-dp-str"),
    pytest.param(lambda: ParallelDims.infer(8, tp=0),
                 ValueError, "tp(0) * pp(1) = 0 does not divide world_size 8; valid values for tp * pp are "
                 "[1, 2, 4, 8]", id="ParallelDims.infer-tp-0"),
    # ---- tensor-parallel layers ------------------------------------------------------------------------------------
    pytest.param(lambda: ColumnParallelLinear(-1, 4),
                 ValueError, "ColumnParallelLinear in_features must be a non-negative integer, got -1",
                 id="ColumnParallelLinear-negative-in"),
    pytest.param(lambda: RowParallelLinear(4, -2),
                 ValueError, "RowParallelLinear out_features must be a non-negative integer, got -2",
                 id="RowParallelLinear-negative-out"),
    pytest.param(lambda: ColumnParallelLinear(4, 4, gather_output=True, sequence_parallel=True),
                 ValueError, "gather_output=True with sequence_parallel=True is not supported",
                 id="ColumnParallelLinear-gather-with-sp"),
    pytest.param(lambda: ColumnParallelLinear(4, 4)(torch.tensor(1.0)),
                 ValueError, "ColumnParallelLinear: input of shape () has last dim None, expected in_features = 4",
                 id="ColumnParallelLinear-0d-input"),
    pytest.param(lambda: RowParallelLinear(4, 2)(torch.randn(2, 3)),
                 ValueError, "RowParallelLinear: input of shape (2, 3) has last dim 3, expected in_features / tp = "
                 "4 / 1 = 4", id="RowParallelLinear-parallel-input-width"),
    pytest.param(lambda: RowParallelLinear(4, 2, input_is_parallel=False)(torch.randn(2, 3)),
                 ValueError, "RowParallelLinear: input of shape (2, 3) has last dim 3, expected in_features = 4",
                 id="RowParallelLinear-full-input-width"),
    pytest.param(lambda: VocabParallelEmbedding(-3, 4),
                 ValueError, "VocabParallelEmbedding num_embeddings must be a non-negative integer, got -3",
                 id="VocabParallelEmbedding-negative-vocab"),
    pytest.param(lambda: VocabParallelEmbedding(10, 4, padding_idx=-1),
                 ValueError, "padding_idx must be in [0, 10), got -1", id="VocabParallelEmbedding-negative-padding"),
    pytest.param(lambda: VocabParallelEmbedding(10, 4)(torch.tensor([1.0])),
                 TypeError, "VocabParallelEmbedding expects integer ids (torch.int64 or torch.int32), got "
                 "torch.float32", id="VocabParallelEmbedding-float-ids"),
    pytest.param(lambda: VocabParallelEmbedding(10, 4)(torch.tensor([-1, 1])),
                 IndexError, "ids must be in [0, 10), got values in [-1, 1]", id="VocabParallelEmbedding-negative-id"),
    pytest.param(lambda: _ce(torch.tensor([1.0, 2.0])),
                 TypeError, "vocab_parallel_cross_entropy expects integer targets (torch.int64 or torch.int32), got "
                 "torch.float32", id="vocab_parallel_cross_entropy-float-target"),
    pytest.param(lambda: _ce(torch.tensor([1, 2, 12])),
                 IndexError, "targets must be in [0, 10) or ignore_index (-100), got values in [1, 12]",
                 id="vocab_parallel_cross_entropy-target-too-large"),
    pytest.param(lambda: _ce(torch.tensor([1, -100, 2]), ignore_index=-1),
                 IndexError, "targets must be in [0, 10) or ignore_index (-1), got values in [-100, 2]",
                 id="vocab_parallel_cross_entropy-wrong-ignore-index"),
    pytest.param(lambda: vocab_parallel_cross_entropy(torch.randn(3, 10), torch.tensor([1, 2, 3]), 10),
                 TypeError, "vocab_parallel_cross_entropy needs the VocabParallelEmbedding whose weight produced the "
                 "logits (for its vocabulary split), got int", id="vocab_parallel_cross_entropy-vocab-size"),
    # ---- parallelize ----------------------------------------------------------------------------------------------
    pytest.param(lambda: parallelize(nn.Sequential(nn.Linear(2, 6)), {"0": Column(fused=4)}),
                 ValueError, "0 has out_features 6, which cannot be fused=4 equal sub-matrices; valid values of fused "
                 "are [1, 2, 3, 6]", id="parallelize-fused-count"),
    pytest.param(lambda: parallelize(nn.Sequential(nn.Linear(2, 6)), {"0": Column(fused=(2, 3))}),
                 ValueError, "0 has out_features 6, but fused=(2, 3) sums to 5; the block sizes must sum to 6",
                 id="parallelize-fused-sizes"),
    pytest.param(lambda: parallelize(nn.Sequential(nn.Linear(2, 6)), [("0", "column")]),
                 TypeError, "plan must be a dict of module-name pattern -> style (e.g. {'layers.*.fc1': 'column'}), "
                 "got list", id="parallelize-plan-list"),
    pytest.param(lambda: parallelize(nn.Sequential(nn.Linear(2, 6)), {"0": Column(activation="relu")}),
                 ValueError, "activation must be one of [None, 'gelu', 'gelu_tanh'], got 'relu'",
                 id="parallelize-Column-activation"),
    # ---- ZeRO, ShardedParam, DataParallel, clip_grad_norm_ ---------------------------------------------------------
    pytest.param(lambda: ZeRO(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
                 TypeError, "optimizer_factory must be a callable that builds the optimizer from the parameters it is "
                 "given (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), got SGD",
                 id="ZeRO-optimizer-instance"),
    pytest.param(lambda: ZeRO(nn.Linear(2, 2), torch.optim.SGD, param_dtype=torch.int8),
                 ValueError, "param_dtype must be None (keep the parameters' dtype) or one of [torch.float32, "
                 "torch.bfloat16, torch.float16, torch.float64], got torch.int8", id="ZeRO-param-dtype"),
    pytest.param(lambda: ZeRO(nn.Linear(2, 2), torch.optim.SGD, reduce_dtype="bf16"),
                 ValueError, "reduce_dtype must be one of [torch.float32, torch.bfloat16, torch.float16, "
                 "torch.float64], got 'bf16'", id="ZeRO-reduce-dtype-str"),
    pytest.param(lambda: ZeRO(nn.Linear(2, 2), torch.optim.SGD),
                 RuntimeError, "ZeRO needs torch.distributed to be initialised (init_parallel or init_process_group)",
                 id="ZeRO-no-process-group"),
    pytest.param(lambda: ShardedParam(nn.Parameter(torch.randn(2)), param_dtype=torch.int32),
                 ValueError, "param_dtype must be None (keep the parameters' dtype) or one of [torch.float32, "
                 "torch.bfloat16, torch.float16, torch.float64], got torch.int32", id="ShardedParam-dtype"),
    pytest.param(lambda: ShardedParam(nn.Parameter(torch.randn(2))),
                 RuntimeError, "ShardedParam needs torch.distributed to be initialised",
                 id="ShardedParam-no-process-group"),
    pytest.param(lambda: DataParallel(nn.Linear(2, 2)),
                 RuntimeError, "DataParallel needs torch.distributed to be initialised (init_parallel or "
                 "init_process_group)", id="DataParallel-no-process-group"),
    pytest.param(lambda: DataParallel(nn.Linear(2, 2), bucket_mb=0),
                 ValueError, "bucket sizes must be positive, got bucket_mb=0, first_bucket_mb=1.0",
                 id="DataParallel-bucket-0"),
    pytest.param(lambda: clip_grad_norm_(nn.Linear(2, 2), 0),
                 ValueError, "max_norm must be positive (a number; float('inf') never clips), got 0",
                 id="clip_grad_norm_-zero"),
    pytest.param(lambda: clip_grad_norm_(nn.Linear(2, 2), float("nan")),
                 ValueError, "max_norm must be positive (a number; float('inf') never clips), got nan",
                 id="clip_grad_norm_-nan"),
    # ---- pipeline ---------------------------------------------------------------------------------------------------
    pytest.param(lambda: build_schedule("1f1b", 0, 4),
                 ValueError, "pipeline size must be a positive integer, got 0", id="build_schedule-ranks-0"),
    pytest.param(lambda: build_schedule("interleaved", 2, 4, 0),
                 ValueError, "virtual stages must be a positive integer, got 0", id="build_schedule-virtual-0"),
    pytest.param(lambda: PipelineStages([nn.Linear(2, 2)], virtual=0),
                 ValueError, "virtual stages must be a positive integer, got 0", id="PipelineStages-virtual-0"),
    pytest.param(lambda: PipelineParallel([nn.Linear(2, 2)], microbatches=2, loss_fn=nn.functional.mse_loss),
                 TypeError, "stages must be a PipelineStages (this rank's chunks of the model), got <class 'list'>",
                 id="PipelineParallel-stages-list"),
    pytest.param(lambda: _pipe(schedule="zb"),
                 ValueError, "schedule must be one of ('gpipe', '1f1b', 'interleaved'), got 'zb'",
                 id="PipelineParallel-schedule"),
    pytest.param(lambda: _pipe(microbatches=0),
                 ValueError, "microbatches must be a positive integer, got 0", id="PipelineParallel-microbatches-0"),
    pytest.param(lambda: _pipe(data_parallel=object()),
                 TypeError, "data_parallel must be a DataParallel or ZeRO wrapper (with no_sync() and "
                 "reduce_gradients()), got <class 'object'>", id="PipelineParallel-data-parallel"),
    pytest.param(lambda: _pipe(tp_group=[0, 1]),
                 TypeError, "tp_group must be a torch.distributed ProcessGroup (the tensor-parallel group of this "
                 "rank's stages) or None, got list", id="PipelineParallel-tp-group"),
    # ---- checkpoint -------------------------------------------------------------------------------------------------
    pytest.param(lambda: checkpoint.save("/nonexistent/ckpt", 1.5, nn.Linear(2, 2)),
                 ValueError, "step must be a non-negative int, got 1.5", id="checkpoint.save-step-float"),
    pytest.param(lambda: checkpoint.save("/nonexistent/ckpt", 1, nn.Linear(2, 2), extra=[1]),
                 TypeError, "extra must be a dict (e.g. {'step': 100, 'samples_seen': 6400}), got list",
                 id="checkpoint.save-extra-list"),
    pytest.param(lambda: checkpoint.load(None, nn.Linear(2, 2)),
                 TypeError, "checkpoint path must be a str or os.PathLike (a step_<N> directory), got None; note that "
                 "latest_checkpoint(root) returns None", id="checkpoint.load-None"),
    pytest.param(lambda: checkpoint.export_state_dict("/nonexistent/step_3"),
                 FileNotFoundError, "checkpoint '/nonexistent/step_3' does not exist; complete checkpoints found next "
                 "to or under it: none", id="checkpoint.export_state_dict-missing"),
    # ---- plan -------------------------------------------------------------------------------------------------------
    pytest.param(lambda: ModelSpec(7e9, 0, 4096, 4096),
                 ValueError, "ModelSpec.layers must be positive, got 0", id="ModelSpec-layers-0"),
    pytest.param(lambda: ModelSpec(1e6, 2, 4096, 4096),
                 ValueError, "params 1e+06 <= the embedding alone (vocab 32000 * hidden 4096 = 1.31e+08)",
                 id="ModelSpec-params-below-embedding"),
    pytest.param(lambda: ClusterSpec(12, 8, 80e9),
                 ValueError, "gpus (12) must be a positive multiple of gpus_per_node (8) or fewer than it",
                 id="ClusterSpec-partial-node"),
    pytest.param(lambda: TrainSpec(precision="fp16"),
                 ValueError, "precision must be one of ['mixed', 'fp32'], got 'fp16'", id="TrainSpec-precision"),
    pytest.param(lambda: TrainSpec(global_batch=0),
                 ValueError, "global_batch must be positive, got 0", id="TrainSpec-global-batch-0"),
]


@pytest.mark.parametrize("call, error, message", CASES)
def test_bad_input_message(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def _error(fn):
    """`type: message` of what fn raises, or 'no error'."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is part of what is compared
        return f"{type(e).__name__}: {e}"
    return "no error"


def _layout_errors(rank, ws):
    messages = [_error(lambda: init_parallel(tp=3, device="cpu"))]
    ctx = init_parallel(tp=2, device="cpu")
    messages += [_error(lambda: ctx.group("sp")), _error(lambda: ctx.coordinate("sp"))]
    return messages


def test_layout_errors_on_every_rank():
    expected = ["ValueError: tp(3) * pp(1) = 3 does not divide world_size 2; valid values for tp * pp are [1, 2]",
                "ValueError: axis must be one of ('pp', 'dp', 'tp'), got 'sp'",
                "ValueError: axis must be one of ('pp', 'dp', 'tp'), got 'sp'"]
    assert run_distributed(_layout_errors, 2) == [expected, expected]


def _vocab_errors(rank, ws):
    emb = VocabParallelEmbedding(10, 4, tp_group=dist.group.WORLD)  # 5 rows per rank
    return [_error(lambda: vocab_parallel_cross_entropy(torch.randn(3, 5), torch.tensor([1, 2, 12]), emb)),
            _error(lambda: emb(torch.tensor([3, 10])))]


def test_out_of_vocabulary_ids_and_targets_raise_on_every_tp_rank():
    expected = ["IndexError: vocab_parallel_cross_entropy: targets must be in [0, 10) or ignore_index (-100), got "
                "values in [1, 12]",
                "TokenIdError: VocabParallelEmbedding: ids must be in [0, 10), got values in [3, 10]"]  # an IndexError
    assert run_distributed(_vocab_errors, 2) == [expected, expected]


def _zero_errors(rank, ws):
    torch.manual_seed(0)
    zero = ZeRO(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1)
    saved = zero.sharded_state_dict()
    moved = {**saved, "world_size": 3}
    one_rank_bad = {**saved, "shards": {k: v for k, v in saved["shards"].items() if rank == 0 or k != "1/0"}}
    return [_error(lambda: zero.load_sharded_state_dict(moved)),
            _error(lambda: zero.load_sharded_state_dict(zero.full_state_dict())),
            _error(lambda: zero.load_sharded_state_dict(one_rank_bad)),
            _error(lambda: zero.clip_grad_norm_(float("nan")))]


def test_zero_state_and_clip_errors_on_every_rank():
    rank0, rank1 = run_distributed(_zero_errors, 2)
    world = ("ValueError: sharded state dict was saved at world size 3, this ZeRO runs at 2; load the full state dict "
             "instead to change the world size")
    keys = ("ValueError: load_sharded_state_dict expects the dict sharded_state_dict() returns, with keys "
            "['world_size', 'rank', 'shards', 'optimizer']; got ['0.weight', '0.bias', '1.weight', '1.bias']")
    missing = "sharded state dict has no shard '1/0' of shape (4,); was it saved with another model or wrap policy?"
    clip = "ValueError: max_norm must be positive (a number; float('inf') never clips), got nan"
    assert rank1 == [world, keys, f"ValueError: {missing}", clip]
    # Rank 0's own state is fine, but it must not go on into the all-gather rank 1 skips.
    assert rank0 == [world, keys, f"ValueError: load_sharded_state_dict failed on rank(s) 1: {missing}", clip]


def _save_with_bad_extra_on_rank_1(rank, ws, root):
    extra = {"loader": object()} if rank == 1 else {"samples_seen": 64}
    return _error(lambda: checkpoint.save(root, 1, nn.Linear(2, 2), extra=extra))


def test_checkpoint_argument_error_on_one_rank_raises_on_every_rank(tmp_path):
    rank0, rank1 = run_distributed(_save_with_bad_extra_on_rank_1, 2, args=(str(tmp_path),))
    assert rank1.startswith("TypeError: extra must hold only JSON values (numbers, strings, lists, dicts)")
    assert rank0.startswith("RuntimeError: checkpoint save failed on 1 rank(s): rank 1: TypeError: extra must hold "
                            "only JSON values")
    assert os.listdir(tmp_path) == []  # refused before anything was written


def _optimizer_errors(rank, ws):
    from parallel_layers import parallelize as compose

    ctx = init_parallel(tp=2, device="cpu")

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))

    plan = {"0": "column", "1": "row"}
    loss = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    early = model()
    before = torch.optim.AdamW(early.parameters())  # built before parallelize: the parameters as they were
    zero = model()
    temperature = nn.Parameter(torch.ones(()))
    second = model()
    prebuilt = torch.optim.AdamW(second.parameters())
    return [_error(lambda: compose(model(), ctx, optimizer=torch.optim.AdamW(early.parameters()), loss_fn=loss,
                                   tp_plan=plan)),
            _error(lambda: compose(early, ctx, optimizer=lambda params: before, loss_fn=loss, tp_plan=plan)),
            _error(lambda: ZeRO(zero, lambda params: torch.optim.AdamW(zero.parameters()), stage=1)),
            _error(lambda: compose(model(), ctx, optimizer=lambda params: torch.optim.AdamW(params[1:]), loss_fn=loss,
                                   tp_plan=plan)),  # a subset of them is the factory's choice
            _error(lambda: compose(model(), ctx, optimizer=lambda params: torch.optim.AdamW(params + [temperature]),
                                   loss_fn=loss, tp_plan=plan)),  # and so is a tensor of its own
            _error(lambda: compose(second, ctx, optimizer=lambda params: prebuilt, loss_fn=loss, tp_plan=plan,
                                   zero_stage=1))]


def test_an_optimizer_built_before_parallelize_is_refused_on_every_rank():
    """Review finding: an optimizer built before parallelize (or ZeRO) stepped the replaced
    parameters, and the loss drifted from the plain model's with no error (tp=2, ZeRO-1)."""
    hint = ("Build it inside the factory from the parameters passed to it (optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=...)): one built before holds the model's parameters as they were, which "
            "tensor parallelism and ZeRO replace, and would train them silently wrong")
    expected = [
        "TypeError: parallelize: optimizer must be a factory that builds the optimizer from the parameters it is "
        "given (e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)), got AdamW: tensor parallelism and "
        "ZeRO replace the model's parameters, so an optimizer built before parallelize would step tensors nothing "
        "reads any more",
        "ValueError: parallelize: the optimizer the factory built steps 4 of the model's parameters as they were "
        f"before parallelize replaced them (shapes [(8, 4), (8,), (4, 8)]), not the 4 tensors it was given. {hint}",
        "no error",  # ZeRO calls the factory with the model's parameters and puts the shards in their place
        "no error", "no error",
        "ValueError: parallelize: the optimizer the factory built steps 4 of the model's parameters as they were "
        f"before parallelize replaced them (shapes [(8, 4), (8,), (4, 8)]), not the 4 tensors it was given. {hint}"]
    assert run_distributed(_optimizer_errors, 2) == [expected, expected]


def _batches_by_global_rank(rank, ws, axis):
    from parallel_layers import parallelize as compose

    ctx = init_parallel(tp=2 if axis == "tp" else 1, pp=2 if axis == "pp" else 1, device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    kwargs = dict(tp_plan={"0": "column", "1": "row"})
    if axis == "pp":
        model = nn.Module()
        model.layers = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        kwargs = dict(pipeline_layers="layers", microbatches=2)
    par = compose(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                  loss_fn=lambda out, y: ((out - y) ** 2).mean(), **kwargs)
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    same = par.forward_backward(rows[:4], rows[:4]).item()  # one batch on every rank: trains
    mine = rows.chunk(ws)[rank]  # the DDP habit: a shard by the global rank
    return same, _error(lambda: par.forward_backward(mine, mine))


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_ranks_of_a_tp_group_or_a_pipeline_given_different_batches_raise_on_every_rank(axis):
    """Review finding: given other rows on each rank of a TP group (a shard by the global rank),
    the model trained on a mixture of both batches with no error; under a pipeline stage 0's
    inputs met the last stage's targets of other rows (Note [same batch check])."""
    what = "tensor-parallel" if axis == "tp" else "pipeline"
    names = "inputs: ranks [0] vs ranks [1]; targets: ranks [0] vs ranks [1]"
    expected = (f"ValueError: the {what} ranks [0, 1] were given different batches ({names}): every rank of a {what} "
                "group must be given the same batch (only the data-parallel replicas take different rows): shard the "
                "data by ctx.coordinate('dp'), not by the global rank")
    (loss0, error0), (loss1, error1) = run_distributed(_batches_by_global_rank, 2, args=(axis,))
    assert loss0 == loss1 and error0 == error1 == expected


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch):
        return self.lin(batch["x"])


def _parallelized_twice(rank, ws):
    from parallel_layers import parallelize as compose
    from parallel_layers import tensor_parallel

    ctx = init_parallel(dp=2, device="cpu")
    sgd, loss = (lambda ps: torch.optim.SGD(ps, lr=0.1)), (lambda out, y: ((out - y) ** 2).mean())
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    compose(model, ctx, optimizer=sgd, loss_fn=loss, zero_stage=3, wrap=lambda m: isinstance(m, nn.Linear))
    layers = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    tensor_parallel.parallelize(layers, {"0": "column", "1": "row"}, tp_group=dist.group.WORLD)
    import transformers

    fresh = compose(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32)), ctx, optimizer=sgd, loss_fn=loss)
    own = compose(DictModel(), ctx, optimizer=sgd, loss_fn=loss)  # a model of the user's that takes a dict
    return [_error(lambda: compose(model, ctx, optimizer=sgd, loss_fn=loss, zero_stage=3)),
            _error(lambda: tensor_parallel.parallelize(layers, {"0": "column", "1": "row"}, tp_group=dist.group.WORLD)),
            _error(lambda: compose(nn.Linear(2, 2), ctx, optimizer=sgd, loss_fn=loss, tp_plan="Auto")),
            _error(lambda: fresh.forward_backward({"input_ids": torch.zeros(2, 4)}, torch.zeros(2, 4))),
            _error(lambda: own.forward_backward({"x": torch.ones(2, 4)}, torch.zeros(2, 4)))]


def test_a_second_parallelize_and_a_misspelt_tp_plan_are_refused_on_every_rank():
    """Review findings: a second parallelize of a ZeRO-3 model (a re-run notebook cell) killed
    both ranks with SIGSEGV (it cloned freed parameters); of a TP model it said ColumnParallelLinear
    'is not supported'; tp_plan='Auto' said the plan must be a dict; a tokenizer's dict as the inputs
    raised an AttributeError from inside the model."""
    expected = [
        "ValueError: parallelize: this Sequential was already parallelized (tp=1 pp=1 dp=2, zero_stage=3); its layers "
        "are sharded or wrapped, and ZeRO-3 has freed its full parameters. Build the model again (its constructor, or "
        "from_pretrained) to parallelize it another way",
        "TypeError: parallelize: the plan names a ColumnParallelLinear: this model is already tensor-parallel "
        "(parallelize ran on it before); build it again to parallelize it another way",
        "ValueError: parallelize: tp_plan must be 'auto' (the plan the model publishes), a dict of module-name pattern "
        "-> style, or None (no tensor parallelism); got 'Auto'",
        "TypeError: forward_backward needs its inputs as one tensor; got dict (a tokenizer's output or a dict? pass "
        "its input_ids as the inputs and its attention_mask as attention_mask=)",
        "no error"]
    assert run_distributed(_parallelized_twice, 2) == [expected, expected]


def _state_dict_of_zero3(rank, ws):
    model, _, zero = _two_layers_at_zero3()
    zero(torch.randn(2, 4)).sum().backward()
    zero.step()
    full = zero.full_state_dict()  # gathers first: allowed
    return sorted(full), _error(lambda: model.state_dict())


def test_a_plain_state_dict_of_a_zero3_model_is_refused():
    """Review finding: torch.save(model.state_dict()) of a ZeRO-3 model wrote tensors without
    storage (the file could not be loaded back), transformers' save_pretrained raised on setStorage."""
    expected = ("RuntimeError: state_dict() of a model that ZeRO-3 shards: 4 of its full parameters (e.g. ['0.weight', "
                "'0.bias', '1.weight']) have no storage between forward and backward, only this rank's shards do. "
                "Read the model through ZeRO: zero.full_state_dict() (every rank), parallel_layers.checkpoint.save(...), "
                "or parallel_layers.hf.save_pretrained(par.module, directory) instead of torch.save(model.state_dict()) "
                "or model.save_pretrained(...)")
    keys = ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert run_distributed(_state_dict_of_zero3, 2) == [(keys, expected), (keys, expected)]


def _batch_check_cases(rank, ws, case):
    from parallel_layers import parallelize as compose

    tp = 2 if case in ("equal sums swapped", "targets differ in the last stage's tp group") else 1
    ctx = init_parallel(tp=tp, pp=ws // tp, device="cpu")
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(16, 4))
    pipelined = case != "equal sums swapped"
    kwargs = dict(pipeline_layers="layers", microbatches=2) if pipelined else {}
    if tp > 1:
        kwargs["tp_plan"] = {"layers.1": "column", "layers.2": "row"}
    par = compose(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                  loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), **kwargs)
    ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1], [5, 6, 7, 8], [9, 9, 9, 9]])  # rows 0 and 1: equal sums
    targets = ids % 4
    last = ctx.coordinate("pp") == ctx.dims.pp - 1
    if case == "placeholders":  # what a rank's stages do not read may be anything of another size
        return _error(lambda: par.forward_backward(ids if ctx.coordinate("pp") == 0 else torch.empty(0),
                                                   targets if last else torch.empty(0, dtype=torch.long)))
    if case == "equal sums swapped":
        mine = ids[[1, 0, 2, 3]] if ctx.coordinate("tp") == 1 else ids
        return _error(lambda: par.forward_backward(mine, targets))
    # targets differ between the TP ranks of the last stage only: every rank of every stage raises
    mine = targets if ctx.coordinate("tp") == 0 or not last else (targets + 1) % 4
    return _error(lambda: par.forward_backward(ids, mine))


def test_the_same_batch_check_reads_what_each_rank_reads_and_sees_swapped_rows():
    """Review findings (helper-34): placeholders of another size on the ranks that do not read
    them were refused; two rows of equal sums swapped passed (position weights linear in the
    position); a TP group of the last stage given different targets raised there only, the
    first stage waited in the next collective until the timeout."""
    assert run_distributed(_batch_check_cases, 2, args=("placeholders",)) == ["no error"] * 2
    hint = ("every rank of a tensor-parallel group must be given the same batch (only the data-parallel replicas "
            "take different rows): shard the data by ctx.coordinate('dp'), not by the global rank")
    swapped = f"ValueError: the tensor-parallel ranks [0, 1] were given different batches (inputs: ranks [0] vs ranks [1]): {hint}"
    assert run_distributed(_batch_check_cases, 2, args=("equal sums swapped",)) == [swapped] * 2
    found = run_distributed(_batch_check_cases, 4, args=("targets differ in the last stage's tp group",))
    own = f"ValueError: the tensor-parallel ranks [2, 3] were given different batches (targets: ranks [2] vs ranks [3]): {hint}"
    other = ("ValueError: the tensor-parallel group of pipeline rank(s) [1] was given different batches (its ranks "
             "name them): every rank of a tensor-parallel group must be given the same batch: shard the data by "
             "ctx.coordinate('dp'), not by the global rank")
    assert found == [other, other, own, own]


def _inner_model_of_zero3(rank, ws, root):
    from parallel_layers import hf
    from parallel_layers import parallelize as compose
    from tests.hf._tiny import save_tiny_llama

    if rank == 0:
        save_tiny_llama(f"{root}/src")
    dist.barrier()
    ctx = init_parallel(dp=2, device="cpu")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/src")
    par = compose(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                  loss_fn=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), zero_stage=3)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    par.forward_backward(ids, ids)
    par.step()
    return [_error(lambda: checkpoint.save(f"{root}/ckpt", 1, model)),
            _error(lambda: hf.save_pretrained(model, f"{root}/export")),
            _error(lambda: hf.load_pretrained(f"{root}/src", model))]


def test_the_model_given_to_zero3_is_refused_where_its_wrapper_is_needed(tmp_path):
    """Review finding (helper-34): checkpoint.save or hf.save_pretrained of the model given to
    parallelize at ZeRO-3, instead of par.module, handed storage-less parameters to DCP: SIGSEGV
    on both ranks."""
    problem = ("20 of the model's tensors (e.g. ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight', "
               "'model.layers.0.self_attn.k_proj.weight']) have no storage: ZeRO-3 frees a model's full parameters "
               "between steps. Pass what parallelize returned (par.module) or the ZeRO wrapper, whose shards hold the "
               "values, not the model given to it")
    for errors in run_distributed(_inner_model_of_zero3, 2, args=(str(tmp_path),)):
        assert len(errors) == 3 and all(problem in e for e in errors), errors


def _two_layers_at_zero3():
    """(model, a plain copy of it, ZeRO-3 over it with each layer a unit) at dp=2."""
    import copy

    ctx = init_parallel(dp=2, device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    zero = ZeRO(model, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=3, group=ctx.dp_group,
                wrap=lambda m: isinstance(m, nn.Linear))
    return model, plain, zero


def _read_freed_zero3_parameters(rank, ws):
    import copy

    from parallel_layers.zero._param import MARKS_FREED

    model, plain, zero = _two_layers_at_zero3()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))  # one batch on both ranks: the plain model's
    losses, reads = [], []
    for step in range(2):
        loss = zero(x).sum()
        if step == 0:  # between forward and backward: the layers are freed again (reshard_after_forward)
            reads.append(_error(lambda: model[0].weight.norm()))
        loss.backward()
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    reads += [_error(lambda: model[1].weight.norm()), _error(lambda: repr(model[0].bias)),
              _error(lambda: copy.deepcopy(model)), _error(lambda: model.to(torch.float64))]
    shapes = [tuple(p.shape) for p in model.parameters()]  # what needs no values still answers
    reference = []
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        loss = plain(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(loss.item())
    full = zero.full_state_dict()
    same = all(torch.allclose(full[k], v, atol=1e-6) for k, v in plain.state_dict().items())
    return MARKS_FREED, reads, shapes, losses == pytest.approx(reference, abs=1e-6), same


def test_reading_a_freed_zero3_parameter_raises_and_training_goes_on():
    """Reading a ZeRO-3 parameter directly between its uses (`layer.weight.norm()`, printing it,
    deepcopy, .to()) dereferenced its freed storage: SIGSEGV on a CPU (an illegal address on a
    GPU), the process gone without a message (Note [reading a freed parameter]). Now each raises
    a RuntimeError naming what works, and the training around it is unaffected: losses and the
    gathered parameters match the plain model's after two steps."""
    results = run_distributed(_read_freed_zero3_parameters, 2)
    if not results[0][0]:
        pytest.skip("this torch build lacks torch._C._set/_clear_storage_data_ptr_access_error_msg")
    message = ("RuntimeError: this parameter's full values are not in memory: ZeRO-3 (parallel_layers' zero_stage=3) "
               "keeps only this rank's shard between uses. Read the full parameters through ZeRO on every rank - "
               "parallel_layers.zero.ZeRO.full_state_dict(), parallel_layers.checkpoint.save(...) or "
               "parallel_layers.hf.save_pretrained(par.module, directory) - or train at zero_stage 1 or 2, which keep "
               "them whole")
    expected = (True, [message] * 5, [(8, 4), (8,), (4, 8), (4,)], True, True)
    assert results == [expected, expected]


def _profile_zero3_with_stacks(rank, ws):
    from torch.profiler import ProfilerActivity, profile

    model, plain, zero = _two_layers_at_zero3()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))

    def step(module, optimizer):
        loss = module(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses, reference = [step(zero, zero)], [step(plain, opt)]  # the layers are freed (and marked) by now
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
            losses += [step(zero, zero) for _ in range(2)]
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    reference += [step(plain, opt) for _ in range(2)]
    profiled = any(e.key == "aten::addmm" for e in prof.key_averages())
    losses.append(step(zero, zero))  # after the profiler: the freed layers are marked again
    reference.append(step(plain, opt))
    return profiled, losses == pytest.approx(reference, abs=1e-6), _error(lambda: model[0].weight.norm())


def _profile_a_pipeline_with_stacks(rank, ws, directory):
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from parallel_layers import parallelize as parallelize_model
    from parallel_layers.pipeline.hf import causal_lm_loss_sum, causal_lm_tokens
    from tests.hf import _tiny

    ctx = init_parallel(pp=2, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    par = parallelize_model(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), loss_fn=causal_lm_loss_sum,
                            token_count=causal_lm_tokens, zero_stage=3, pipeline_layers="auto", microbatches=2)
    losses = []

    def step(ids):
        losses.append(float(par.forward_backward(ids, ids)))
        par.step()
        par.zero_grad()

    batches = _tiny.token_batches(3, 4, 16, 128)
    step(batches[0])  # the stages' units are freed (and marked) by now
    try:
        with profile(activities=[ProfilerActivity.CPU], with_stack=True):
            step(batches[1])
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    step(batches[2])
    return losses


def _read_under_a_profiler_without_stacks(rank, ws):
    from torch.profiler import ProfilerActivity, profile

    model, _, zero = _two_layers_at_zero3()
    zero(torch.randn(2, 4)).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]):  # no Python tracer: the marks stay
        zero(torch.randn(2, 4)).sum().backward()
        return _error(lambda: model[1].weight.norm())


def test_a_zero3_step_profiled_with_stacks_under_a_pipeline(tmp_path):
    """A pipeline calls its stages directly, so ZeRO's check at the model's forward never ran and
    the tracer raised at stage 0's embedding (review finding, helper-70): the pipeline's step
    checks first. The profiled step trains as the unprofiled ones (the same losses as plain);
    a profiler without stacks leaves the marks on: a freed parameter read under it still raises
    (it crashed with SIGSEGV while the marks were off for every profiler)."""
    import transformers

    from tests.hf import _tiny

    _tiny.save_tiny_llama(tmp_path)
    results = run_distributed(_profile_a_pipeline_with_stacks, 2, args=(str(tmp_path),))
    assert all(not isinstance(r, str) for r in results), results
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain = _tiny.plain_losses(model, opt, _tiny.token_batches(3, 4, 16, 128))
    assert results[1] == pytest.approx(plain, abs=1e-5), (results, plain)  # the last stage's losses
    for read in run_distributed(_read_under_a_profiler_without_stacks, 2):
        assert read.startswith("RuntimeError: this parameter's full values are not in memory"), read


def test_a_zero3_step_profiled_with_stacks():
    """torch.profiler's Python tracer (with_stack=True) reads the data pointer of each called
    module's parameters before ZeRO-3's hooks gather them, and the mark of a freed parameter
    raised there: a ZeRO-3 model could not be profiled with stacks (session 39). While a
    profiler runs the marks are off; the profiled steps train as the plain model does, and the
    mark is back for the first forward after the profiler."""
    from parallel_layers.zero._param import MARKS_FREED

    results = run_distributed(_profile_zero3_with_stacks, 2)
    assert all(not isinstance(r, str) for r in results), results
    for profiled, trained, read in results:
        assert profiled and trained, results
        if MARKS_FREED:
            assert read.startswith("RuntimeError: this parameter's full values are not in memory"), read


def _meta_adagrad(rank, ws):
    ctx = init_parallel(dp=2, device="cpu")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    zero = ZeRO(model, lambda ps: torch.optim.Adagrad(ps, lr=0.1), stage=3, group=ctx.dp_group,
                wrap=lambda m: isinstance(m, nn.Linear))
    zero.materialize("cpu")
    zero(torch.randn(2, 4)).sum().backward()
    return _error(zero.step)


def test_optimizer_state_left_on_the_meta_device_is_named_at_the_first_step():
    """Review finding (helper-38): Adagrad builds its accumulator in its constructor; over a model
    built on the meta device it stayed there when the model got storage, and the first step failed
    with 'Tensor on device cpu is not on the expected device meta!'."""
    expected = ("RuntimeError: ZeRO.step: the optimizer (Adagrad) holds 4 state tensor(s) on the meta device: it built "
                "them in its constructor over a model built on the meta device, and loading the weights gave the "
                "parameters storage, not the optimizer's state. Resume from a checkpoint (checkpoint.load fills the "
                "state), build the model for real, or use an optimizer that creates its state at the first step (SGD, "
                "Adam, AdamW)")
    assert run_distributed(_meta_adagrad, 2) == [expected, expected]


def _token_id_errors(rank, ws, directory, layout):
    import transformers

    from parallel_layers import parallelize as compose
    from parallel_layers.pipeline.hf import causal_lm_loss

    pp, tp = 2 if layout.startswith("pp2") else 1, 2 if layout == "dp2-tp2" else 1
    ctx = init_parallel(pp=pp, tp=tp, dp=ws // pp // tp, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    par = compose(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=causal_lm_loss,
                  zero_stage=3 if layout.endswith("zero3") else 0, pipeline_layers="auto" if pp > 1 else None,
                  tp_plan="auto" if tp > 1 else None, expert_parallel=layout.endswith("ep"))
    replica = ctx.coordinate("dp")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    bad = ids.clone()
    bad[1, 3], bad[2, 5] = 130, -1  # the same batch on every rank: every rank raises
    errors = [_error(lambda: par.forward_backward(bad, ids)), _error(lambda: par.evaluate(ids.float(), ids))]
    if ws // pp // tp > 1:  # one replica's batch refused: every replica raises (Note [a refusal on every replica])
        errors += [_error(lambda: par.forward_backward(bad if replica == 1 else ids, ids)),
                   _error(lambda: par.forward_backward(ids, ids, attention_mask=torch.ones(4, 8 if replica else 16,
                                                                                 dtype=torch.int64))),
                   _error(lambda: par.evaluate(bad if replica == 1 else ids, ids))]
    while len(errors) < 5:
        errors.append(None)  # (one replica: nothing to refuse on one replica only)
    # labels out of range for the causal-LM loss, on the last replica (Note [labels in range])
    labels = ids.clone()
    labels[0, 0], labels[1, 3], labels[2, 2], labels[3, 4] = 999, 128, -100, -7  # column 0 is not read
    errors.append(_error(lambda: par.forward_backward(ids, labels if replica == ws // pp // tp - 1 else ids)))
    if layout == "dp2":  # a stale config.vocab_size is not the bound: the tables' rows are (review finding, helper-81)
        model.config.vocab_size, labels[1, 3], labels[3, 4] = 160, 150, 5
        errors.append(_error(lambda: par.forward_backward(ids, labels if replica == 1 else ids)))
        model.config.vocab_size = 128
    # training goes on in step: one step on the same batch everywhere, as the plain model takes it
    par.forward_backward(ids, ids)
    par.step()
    par.zero_grad()
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
    causal_lm_loss(plain(ids).logits, ids).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    with torch.no_grad():
        return errors, par.evaluate(ids, ids).item(), causal_lm_loss(plain.eval()(ids).logits, ids).item()


@pytest.mark.parametrize("layout", ["dp2-zero3", "dp2", "pp2", "dp2-tp2", "dp2-ep", "pp2-dp2-ep", "pp2-dp2-zero3"])
def test_out_of_vocabulary_ids_name_the_values_and_the_range(tmp_path, layout):
    """Review findings (helper-76, helper-77): without tensor parallelism a transformers model's embedding
    raised torch's "index out of range in self" (no value, no range), and a float batch an error
    about argument #1 'indices' (Note [token ids in range] in parallel_layers/_token_ids.py).
    Under a pipeline rank 0's ids are checked on every pipeline rank. A batch one data-parallel
    replica refuses is refused by every replica (Note [a refusal on every replica]): raised there
    alone, it left the others waiting in the gradient all-reduce (review finding, session 40)."""
    from tests.hf import _tiny

    (_tiny.save_tiny_mixtral if layout.endswith("ep") else _tiny.save_tiny_llama)(tmp_path)  # ep: experts spread
    expected = "token ids must be in [0, 128) (the model's input embedding has 128 rows), got values in [-1, 130]"
    results = run_distributed(_token_id_errors, 4 if layout in ("dp2-tp2", "pp2-dp2-ep", "pp2-dp2-zero3") else 2,
                              args=(str(tmp_path), layout))
    for rank, (errors, loss, plain) in enumerate(results):
        replica = rank // 2 if layout == "dp2-tp2" else rank % 2  # the mesh is (pp, dp, tp)
        assert errors[0] == f"TokenIdError: {expected}"  # an IndexError and a ValueError at every layout
        if layout.startswith("pp2"):
            assert errors[1].startswith("ValueError: a pipelined ")
            assert "decoder takes token ids [batch, seq] (int64)" in errors[1]
        else:
            assert errors[1] == ("TypeError: forward_backward needs token ids (an integer tensor, torch.int64) as the "
                                 "inputs of a transformers model; got torch.float32")
        if layout != "pp2":  # several replicas
            # the replica given a bad batch raises its own error, the other one the same kind naming it
            assert errors[2] == (f"TokenIdError: {expected}" if replica == 1 else
                                 f"TokenIdError: data-parallel replica 1's batch was refused: {expected}")
            mask = ("attention_mask must be an integer or bool tensor of the inputs' shape [4, 16] (1: a token to "
                    "attend to, 0: padding); got shape [4, 8] and dtype torch.int64") if layout.startswith("pp2") else \
                ("attention_mask must have the inputs' shape [4, 16] (1: a token to attend to, 0: padding); got shape "
                 "[4, 8]")
            assert errors[3] == (f"ValueError: {mask}" if replica == 1 else
                                 f"ValueError: data-parallel replica 1's batch was refused: {mask}")
            # an evaluation agrees where it is a collective over dp anyway (ZeRO-3's gathers, the
            # experts' all-to-alls: review finding, helper-78); under DataParallel one replica raises alone
            alone = layout in ("dp2", "dp2-tp2")
            assert errors[4] == (f"TokenIdError: {expected}" if replica == 1 else "no error" if alone else
                                 f"TokenIdError: data-parallel replica 1's batch was refused: {expected}")
        # F.cross_entropy's "Target 128 is out of bounds." on one rank before (under a pipeline: on
        # every rank at the step's end, as the last stage's failure)
        labels = ("labels must be in [0, 128) or -100 (ignored) for the causal-LM loss (the model's vocabulary "
                  "has 128 entries), got values in [-7, 128] (labels[:, 0] is not read)")
        assert errors[5] == (f"TokenIdError: {labels}" if replica == 1 or layout == "pp2" else
                             f"TokenIdError: data-parallel replica 1's batch was refused: {labels}")
        if layout == "dp2":
            stale = labels.replace("[-7, 128]", "[5, 150]")
            assert errors[6] == (f"TokenIdError: {stale}" if replica == 1 else
                                 f"TokenIdError: data-parallel replica 1's batch was refused: {stale}")
        assert 0 < loss < 10  # a next-token loss of a 128-token vocabulary, ~ln(128) = 4.85
        assert loss == pytest.approx(plain, rel=1e-5)  # no replica a step ahead, no gradient of a refused batch


def _refusals_asserted_on_the_device(rank, ws):
    from parallel_layers import _device_assert, _replica_refusal

    _replica_refusal._on_device = lambda device, sync: not sync  # a GPU group's path, on gloo's CPU tensors
    failed = []  # the asserts that would fire, recorded as CUDA's do: asynchronously, after the host's raise

    def record(condition, message):
        assert len(_device_assert.fitted(message)) < 255, message  # CUDA's bound on the message
        if not bool(condition):
            failed.append(_device_assert.fitted(message))
    _replica_refusal.assert_async = record
    group = dist.group.WORLD
    flag = torch.tensor(rank == 1)
    calls = [lambda: _replica_refusal.refuse_together(None, group, flagged=torch.tensor(False),
                                                      flagged_message="ids out of range", sync=False),
             lambda: _replica_refusal.refuse_together(None, group, flagged=flag, flagged_message="ids out of range",
                                                      sync=False),
             lambda: _replica_refusal.refuse_together(ValueError("a bad mask") if rank == 1 else None, group,
                                                      sync=False),
             # read back on the host: a peer raises the nearest kind it knows (review finding, helper-78)
             lambda: _replica_refusal.refuse_together(_OwnTypeError("a dict") if rank == 1 else None, group)]
    results = []
    for call in calls:
        failed.clear()
        results.append((_error(call), list(failed)))
    return results


class _OwnTypeError(TypeError):
    pass


def test_a_refusal_on_a_gpu_group_is_asserted_on_every_replica():
    """Note [a refusal on every replica]: on a GPU the flags are reduced and asserted on the device
    (no host sync a step); the asserts recorded here as they would fire: one replica's ids out of
    range or refused batch stops every replica - the refusing one too, after raising its own
    error (review finding, helper-83: caught there, its next step waited for stopped peers) -
    and no refusal stops none."""
    results = run_distributed(_refusals_asserted_on_the_device, 2)
    refused = "a data-parallel replica refused its batch (its rank raised the reason); every replica stops"
    for rank, (none, ids, mask, kind) in enumerate(results):
        assert kind == (("_OwnTypeError: a dict" if rank == 1 else
                         "TypeError: data-parallel replica 1's batch was refused: a dict"), [])
        assert none == ("no error", [])
        assert ids == ("no error", ["ids out of range on a data-parallel replica; every replica stops"])
        assert mask == ("ValueError: a bad mask" if rank == 1 else "no error", [refused])


def test_a_device_assert_message_fits_cudas_bound(monkeypatch):
    """Note [a device assert's message]: CUDA's _assert_async refuses a message of 255 characters
    or more, on the host, whether the condition holds or not; the same-batch check named every
    rank of its group and wrote 255 for the TP ranks 8-15 of a two-node tp=8 job (review finding,
    helper-83). Every device assert's message is fitted, and the same-batch one names a group's
    ranks in short."""
    from parallel_layers import _device_assert, _same_batch

    seen = []
    monkeypatch.setattr(_device_assert.torch, "_assert_async", lambda condition, message: seen.append(message))
    _device_assert.assert_async(torch.tensor(True), "x" * 1000)
    _device_assert.assert_async(torch.tensor(True), "short")
    assert seen == ["x" * 246 + "...", "short"]
    assert _same_batch._ranks_text([8, 9, 10, 11, 12, 13, 14, 15]) == "8..15"
    assert _same_batch._ranks_text([3, 11, 19, 27, 35]) == "3..35 (every 8th)"
    assert _same_batch._ranks_text([0, 1, 2]) == "[0, 1, 2]"
    assert _same_batch._ranks_text([0, 1, 5, 9, 1023]) == "[0, 1, ..., 1023] (5 ranks)"
    for what in ("tensor-parallel", "pipeline"):
        for ranks in ([1016 + i for i in range(8)], list(range(0, 1024, 8)), [0, 3, 700, 1023, 4095]):
            message = _same_batch.device_message(what, ranks)
            assert len(message) < 255 and message == _device_assert.fitted(message), message
            assert "shard the data by ctx.coordinate('dp')" in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_long_device_assert_message_on_cuda_is_taken():
    """Note [a device assert's message]: torch's CUDA assert raised on the host for a message of
    255 characters or more, even when the condition held; fitted, a true condition passes."""
    from parallel_layers._device_assert import assert_async

    assert_async(torch.tensor(True, device="cuda"), "x" * 1000)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_token_ids_on_a_gpu_give_a_device_flag_for_the_replicas_to_reduce():
    """On a GPU the ids are checked on the device and the flag returned, not asserted on this rank
    alone (which would stop it before the replicas' all-reduce); with no other replica it is asserted."""
    from parallel_layers._replica_refusal import refuse_together
    from parallel_layers._token_ids import check_labels, check_token_ids

    model = nn.Module()
    model.get_input_embeddings = lambda: nn.Embedding(128, 4)
    good = check_token_ids(torch.tensor([[0, 127]], device="cuda"), model)
    bad = check_token_ids(torch.tensor([[0, 128]], device="cuda"), model)
    assert good[0].is_cuda and not bool(good[0]) and bool(bad[0])
    assert bad[1] == "token ids must be in [0, 128)"
    refuse_together(None, None, flagged=good[0], flagged_message=good[1], sync=False)
    torch.cuda.synchronize()  # the good flag's assert passed
    labels = torch.tensor([[999, 5, -100], [-1, 127, 0]], device="cuda")  # column 0 is not read
    flag, message = check_labels(labels, 128)
    assert not bool(flag) and message == "labels must be in [0, 128) or -100"
    labels[1, 2] = 128
    assert bool(check_labels(labels, 128)[0])


def test_labels_the_causal_lm_loss_reads_are_checked():
    """Note [labels in range]: only labels[:, 1:] are read (the shift), -100 is ignored; a tensor
    that is no batch of label rows is left to the loss."""
    from parallel_layers._token_ids import TokenIdError, check_labels

    assert check_labels(torch.tensor([[999, 5, -100], [-1, 127, 0]]), 128) is None
    assert check_labels(torch.full((2, 4), -100), 128) is None
    assert check_labels(torch.zeros(2, 4), 128) is None and check_labels(torch.tensor([3, 200]), 128) is None
    with pytest.raises(TokenIdError, match=re.escape("got values in [0, 128] (labels[:, 0] is not read)")):
        check_labels(torch.tensor([[5, 0, 128], [5, -100, 3]]), 128)


def test_a_token_id_error_is_an_index_error_and_a_value_error():
    """One `except` catches it at every layout: nn.Embedding's and VocabParallelEmbedding's are
    IndexErrors, the pipeline's batch refusals ValueErrors (review finding, helper-77)."""
    from parallel_layers._token_ids import TokenIdError

    assert issubclass(TokenIdError, IndexError) and issubclass(TokenIdError, ValueError)
