"""`parallelize(model, ctx, ...)`: apply every kind of parallelism to a model, in one fixed
order, and return what trains.

    ctx = init_parallel(dp=2, tp=2, pp=2)
    torch.manual_seed(0)                       # every rank builds the same single-device model
    model = MyModel()                          # its layers in model.layers: embedding, Blocks, head
    par = parallelize(model, ctx, tp_plan={"layers.*.up": "column", "layers.*.down": "row"},
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), loss_fn=model.loss,
                      zero_stage=1, wrap=lambda m: isinstance(m, Block),
                      pipeline_layers="layers", schedule="1f1b", microbatches=4)
    for ids, targets in data:
        loss = par.forward_backward(ids, targets)          # this replica's batch loss
        par.clip_grad_norm_(1.0)
        par.step(); par.zero_grad()
    checkpoint.save(root, step, par.module, par.optimizer, prefix=par.prefix)

Note [parallelize order]: the steps, innermost first, as torchtitan's `parallelize_llama`
applies TP, then activation checkpointing, then FSDP, with the pipeline schedule on top:

  1. tensor parallelism (`tp_plan`, parallel_layers/tensor_parallel/plan.py) on the whole
     model, in place. Every rank holds the whole model at this point, so plan patterns name
     modules as the user wrote them, and the layers shard the same weights on every pipeline
     rank (the same seed gives the same model). Then expert parallelism (`expert_parallel`:
     each MoE layer's experts, split over tp if TP ran, spread over the dp ranks or groups of them;
     parallel_layers/expert_parallel.py), also on the whole model, so every rank creates the
     same process groups whatever its pipeline stage holds.
  2. activation checkpointing (`activation_checkpointing="full"` or `"selective"`) of the
     blocks `wrap` selects (parallel_layers/activation_checkpointing.py): after TP, so the
     recompute re-runs the TP layers' collectives; before step 4, so the checkpointed forward
     sits inside the data-parallel wrapper's module hooks (ZeRO-3 gathers the parameters for
     the block's backward, and the recompute runs then; Note [checkpoint inside the hooks]).
  3. the model moves to `ctx.device` (one built on the meta device stays there until
     `hf.load_pretrained` or `meta.materialize` gives it storage there); with a pipeline,
     this rank keeps its stages (`PipelineStages` over the `pipeline_layers` list). The cut
     comes before step 4 because the data-parallel wrapper must shard and reduce only the
     parameters this rank trains.
  4. DataParallel (`zero_stage=0`, only when dp > 1) or ZeRO stage 1-3 over the dp axis, around
     this rank's part of the model; it owns the optimizer (ZeRO) or the optimizer is built on
     the wrapped parameters.
  5. the pipeline schedule (`PipelineParallel`) outermost: it drives the microbatches through
     the stages and tells the wrapper of step 4 to reduce gradients once per step, after the
     last microbatch (its `no_sync()`).

A pipeline runs when pp > 1 or microbatches > 1 (at pp = 1 the schedule accumulates gradients
over the microbatches). Its layers are `model.<pipeline_layers>`, a sequence of modules that
each take one tensor and return one; it must hold every parameter of the model, so that a
checkpoint of the stages names tensors as the unparallelized model does (`prefix`).
`pipeline_layers="auto"` cuts an unmodified Hugging Face causal LM (Llama, Mistral, Qwen2/3,
GPT-2) into its own modules: embedding, each decoder layer, final norm + head
(parallel_layers/pipeline/hf.py, Note [hf pipeline layers]); its tensors keep the Hugging Face
names (`prefix` ""), and it always runs as a pipeline, even at pp = 1 with one microbatch,
because the model's own forward returns a ModelOutput, not the logits that `loss_fn` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import warnings
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from parallel_layers import activation_checkpointing as activation_checkpointing_module
from parallel_layers import expert_parallel as expert_parallel_module
from parallel_layers import _optimizer, _same_batch, fused, meta
from parallel_layers._accumulation import token_divisor
from parallel_layers._replica_refusal import refuse_together
from parallel_layers._token_ids import check_labels, check_token_ids, input_vocab, reads_labels
from parallel_layers._loss_scale import LossScale
from parallel_layers.checkpoint import _dist
from parallel_layers.data_parallel import DataParallel
from parallel_layers.grad_norm import clip_grad_norm_
from parallel_layers.parallel_dims import ParallelContext
from parallel_layers.pipeline import PipelineParallel, PipelineStages
from parallel_layers.pipeline import hf as hf_pipeline
from parallel_layers.tensor_parallel import plan as tp_plan_module
from parallel_layers.zero import ZeRO
from parallel_layers.zero._param import check_dtypes
from parallel_layers.zero.api import refuse_non_floating, route_zero_grad


@dataclasses.dataclass
class Parallelized:
    """What `parallelize` returns: one training step of the parallel model, and what a
    checkpoint saves and loads: `checkpoint.save(root, step, module, optimizer, prefix=prefix)`."""

    module: nn.Module  # as trained: the ZeRO / DataParallel wrapper, else the stages or the model
    optimizer: torch.optim.Optimizer  # ZeRO's (over its shards) or the one built on `module`'s parameters
    prefix: str  # prepended to the stages' keys: the unparallelized model's names ("layers.")
    pipeline: PipelineParallel | None
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    ctx: ParallelContext
    token_count: Callable[[Tensor], Tensor] | None = None
    loss_scale: LossScale | None = None  # float16's (Note [one loss scale for every rank] in _loss_scale.py)
    _overflowed: bool | None = dataclasses.field(default=None, init=False, repr=False)  # None: not unscaled yet
    _materialized: bool = dataclasses.field(default=False, init=False, repr=False)
    _stepped: bool = dataclasses.field(default=False, init=False, repr=False)
    _warned_mean: bool = dataclasses.field(default=False, init=False, repr=False)
    _read_labels: bool = dataclasses.field(default=False, init=False, repr=False)
    _use_cache_kw: bool | None = dataclasses.field(default=None, init=False, repr=False)
    _expert_parallel: bool | None = dataclasses.field(default=None, init=False, repr=False)  # None: not looked yet
    # the model as the user holds it (every rank: all of it, another pipeline rank's stages as
    # placeholders), and the parameters it had when parallelized (Note [parameters added after
    # parallelize])
    _model: nn.Module | None = dataclasses.field(default=None, repr=False)
    _checked: bool = dataclasses.field(default=False, init=False, repr=False)  # this step's parameters

    def __post_init__(self):
        if self._model is None:
            self._model = self.module
        for p in self._model.parameters():
            _mark_built(p)

    def forward_backward(self, inputs: Tensor, targets: Tensor, *, attention_mask: Tensor | None = None,
                         position_ids: Tensor | None = None) -> Tensor:
        """Forward and backward of this replica's batch, gradients reduced over dp; returns its
        loss (detached; with a pipeline, on every pipeline rank; with token_count, its sum over the
        count of the dp replicas' batches / dp, whose mean over dp is the whole batch's loss). attention_mask: a padded
        batch's [batch, seq] mask, for a model (or pipeline layers) that takes one. position_ids:
        [batch, seq] (or [1, seq]) positions for the model's forward (left padding under learned
        positions, packed sequences), at any layout (a pipeline's side input)."""
        self._check_batch(inputs, targets, attention_mask, position_ids)
        self._refuse_parameters_added_later()
        if self.pipeline is not None:
            self.pipeline.grad_scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
            return self.pipeline.step(inputs, targets, attention_mask=attention_mask, position_ids=position_ids)
        loss = self._loss(inputs, targets, attention_mask, position_ids)
        (loss * self.loss_scale.scale if self.loss_scale is not None else loss).backward()
        return loss.detach()

    def evaluate(self, inputs: Tensor, targets: Tensor, *, attention_mask: Tensor | None = None,
                 position_ids: Tensor | None = None) -> Tensor:
        """The loss of this replica's batch as forward_backward returns it, with the model in eval
        mode (no dropout) and no gradient kept, at any layout: a validation step, as torchtitan's
        validator runs one. With `token_count` that is this replica's loss sum over the batch's
        token count averaged over the dp replicas - a collective over dp, so every replica calls
        it - whose mean over the replicas is the global token mean; replicas given batches of
        unequal token counts get unequal shares of it, not each its own mean (review finding,
        helper-77). With a pipeline it runs the schedule's forwards and their messages only
        (`schedule.forward_only`; no gradient message, no gradient reduced), so every pipeline rank
        gets the loss; `module(inputs)` there would return a stage's activations. A batch the
        microbatches do not divide (a validation set's last) is split into fewer equal parts
        (Note [evaluating any batch] in pipeline/runtime.py). The optimizer is not touched."""
        self._check_batch(inputs, targets, attention_mask, position_ids, evaluating=True)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                if self.pipeline is not None:
                    return self.pipeline.step(inputs, targets, attention_mask=attention_mask, position_ids=position_ids)
                return self._loss(inputs, targets, attention_mask, position_ids)
        finally:
            self.module.train(was_training)

    def _loss(self, inputs: Tensor, targets: Tensor, attention_mask: Tensor | None,
              position_ids: Tensor | None = None) -> Tensor:
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        kwargs = {k: v for k, v in given.items() if v is not None}
        if self._use_cache_kw is None:  # once: inspecting the forward's signature each step costs ~20 us
            self._use_cache_kw = _takes_use_cache(_innermost(self.module))
        if self._use_cache_kw:
            kwargs["use_cache"] = False  # Note [no cache in a training step]
        out = self.module(inputs, **kwargs)
        loss = self.loss_fn(out, targets)
        # the logits ([tokens, vocab], float32 for a Hugging Face model) are not needed by backward:
        # holding them through it kept one more such copy at the step's peak (Note [peak memory] in plan/cost.py)
        del out
        if self.token_count is not None:  # loss_fn returned a sum: the batch's count over dp divides it
            divisor = token_divisor(self.token_count(targets), self._dp_group(), loss.device).to(loss.dtype)
            # a batch with no labelled token on any replica: loss 0 and no gradient, as the pipeline
            # gives (0 / 0 was NaN); chosen on the device, without a host sync
            loss = loss * torch.where(divisor > 0, divisor.reciprocal(), torch.zeros_like(divisor))
        return loss

    # Note [no cache in a training step]: a transformers model called with its config's
    # use_cache=True builds a DynamicCache of every layer's keys and values, which a training or
    # evaluation step never reads; and with a cache, transformers' mask code does not look for
    # packed sequences (position_ids that restart, no attention_mask), so documents of a packed
    # row attended to each other (0.28 off the per-document logits on a tiny Llama). The pipeline's
    # decoder layers already ran without one (pipeline/hf.py), so the layouts agreed only on
    # unpacked batches. The step passes use_cache=False, as transformers' gradient checkpointing does.
    def _check_batch(self, inputs, targets, attention_mask, position_ids=None, *, evaluating: bool = False) -> None:
        if not self._materialized:  # once: the first step of a model built on the meta device
            if meta.has_meta(self.module):  # every rank built it so: every rank raises
                raise RuntimeError(
                    "parallelize: the model still has tensors on the meta device (it was built under "
                    "torch.device('meta')), so there is nothing to train yet. Give them storage and values first: "
                    "hf.load_pretrained(directory, par) for a Hugging Face model; to resume from a checkpoint, "
                    "hf.materialize(par) then checkpoint.load(...); or parallel_layers.meta.materialize(par.module, "
                    "device) and your own initialisation")
            self._materialized = True
        if self.pipeline is None:  # a pipeline checks its batch itself, over its ranks and the replicas
            refused, flagged = None, None
            try:
                flagged = self._refusals(inputs, targets, attention_mask, position_ids)
            except (TypeError, ValueError) as e:  # a TokenIdError is a ValueError
                refused = e
            # every replica raises what one refused (Note [a refusal on every replica]); an evaluation
            # only where it is a collective over dp anyway (ZeRO-3's all-gathers, token_count's divisor,
            # expert parallelism's all-to-alls: review finding, helper-78)
            if self._expert_parallel is None:
                self._expert_parallel = expert_parallel_module.used_in(self.module)
            together = (not evaluating or self.token_count is not None or getattr(self.module, "stage", 0) == 3
                        or self._expert_parallel)
            refuse_together(refused, self.ctx.dp_group if together and self.ctx.dims.dp > 1 else None,
                            flagged=flagged[0] if flagged else None, flagged_message=flagged[1] if flagged else "",
                            sync=False)
        self._warn_mean_over_padding(attention_mask, targets)

    def _refusals(self, inputs, targets, attention_mask, position_ids) -> tuple[Tensor, str] | None:
        """Raise on a batch this replica cannot take (without a pipeline); on a GPU return the
        device flag of token ids or labels out of range and its message instead (Note [token ids
        in range], Note [labels in range])."""
        # the TP group's ranks compare their batches first: then a bad mask or positions (or a dict
        # for inputs) given to every rank raise on every rank, and one given to some ranks only is a
        # difference
        if self.ctx.dims.tp > 1:  # Note [same batch check] (a pipeline checks its own)
            _same_batch.check((inputs, targets, attention_mask, position_ids),
                              ("inputs", "targets", "attention_mask", "position_ids"), self.ctx.tp_group,
                              "tensor-parallel")
        model = _innermost(self.module)
        if isinstance(inputs, Mapping) and hasattr(model, "config"):
            # a tokenizer's output given to a transformers model (which would take it as input_ids); a model
            # of the user's own may take a dict
            raise TypeError(f"forward_backward needs its inputs as one tensor; got {type(inputs).__name__} (a "
                            "tokenizer's output or a dict? pass its input_ids as the inputs and its attention_mask as "
                            "attention_mask=)")
        flags = []
        if isinstance(inputs, Tensor) and hasattr(model, "config"):
            flags.append(check_token_ids(inputs, model))  # Note [token ids in range] in _token_ids.py
            vocab = input_vocab(model)
            if reads_labels(targets, self.loss_fn) and vocab is not None:
                flags.append(check_labels(targets, vocab))  # Note [labels in range]
        if (isinstance(attention_mask, Tensor) and isinstance(inputs, Tensor)
                and attention_mask.dim() == 2 and attention_mask.shape != inputs.shape
                and hasattr(model, "config")):
            # a transformers model takes a [batch, seq] mask of another width without a word (it
            # slices or broadcasts it): a left-padded batch's loss changed (review finding); the
            # pipeline refuses it too (errors.md row 109d). A 4-D mask is the user's own, passed on.
            raise ValueError(f"attention_mask must have the inputs' shape {list(inputs.shape)} (1: a token to attend "
                             f"to, 0: padding); got shape {list(attention_mask.shape)}")
        if (position_ids is not None and isinstance(inputs, Tensor)
                and hasattr(model, "config")
                and (not isinstance(position_ids, Tensor) or position_ids.is_floating_point()
                     or position_ids.dim() != 2 or position_ids.shape[-1] != inputs.shape[-1]
                     or position_ids.shape[0] not in (1, inputs.shape[0]))):
            got = (f"shape {list(position_ids.shape)} and dtype {position_ids.dtype}" if isinstance(position_ids, Tensor)
                   else type(position_ids).__name__)
            raise ValueError(f"position_ids must be an integer tensor of the inputs' shape {list(inputs.shape)} (or [1, "
                             f"{inputs.shape[-1]}]); got {got}")
        flags = [f for f in flags if f is not None]  # on a GPU: one device flag, and the messages
        if not flags:
            return None
        flag = functools.reduce(lambda a, b: a | b.to(a.device), [f for f, _ in flags])  # ids and labels may differ
        return flag, "; ".join(m for _, m in flags)

    def checkpoint_parts(self) -> tuple[nn.Module, torch.optim.Optimizer, str]:
        """What `checkpoint.save(root, step, par)` / `load(path, par)` save and load: the module as
        trained, its optimizer, the prefix of its keys."""
        return self.module, self.optimizer, self.prefix

    def _warn_mean_over_padding(self, attention_mask, targets=None) -> None:
        """Once: a padded batch - a mask, or labels the loss ignores (-100: a prompt masked out, padding
        without a mask; review finding, helper-67) -, a loss_fn that returns a mean, and several replicas
        or microbatches whose means the step averages (Note [token mean over data parallelism] in
        _accumulation.py)."""
        if self.token_count is not None or self._warned_mean:
            return
        dp = self.ctx.dims.dp
        m = self.pipeline.microbatches if self.pipeline is not None else 1
        if dp * m == 1:
            return
        said = attention_mask is not None
        where = "padded batch (attention_mask=)"
        if not said and not self._read_labels and isinstance(targets, Tensor) and not targets.is_floating_point():
            # the first batch's labels only: reading them back is a host synchronisation on a GPU
            self._read_labels = True
            said, where = bool((targets == -100).any()), "batch with ignored labels (-100)"
            # the ranks holding labels (a pipeline's last stage): one of them says it
            said = said and self.ctx.coordinate("dp") == 0 and self.ctx.coordinate("tp") == 0
            mine = said
        else:
            mine = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if not said:
            return
        self._warned_mean = True
        if mine:
            parts = " and ".join(p for p in (f"{dp} data-parallel replicas" if dp > 1 else "",
                                             f"{m} microbatches" if m > 1 else "") if p)
            warnings.warn(
                f"parallelize: a {where} and no token_count= (so loss_fn is taken to return a mean): "
                f"the step averages the means of its {parts}, each over its own tokens, so a token of a part with "
                "fewer labelled tokens weighs more than in the plain model's mean over the whole batch (transformers' "
                "Trainer divides by the batch's count, num_items_in_batch). For that mean pass "
                "loss_fn=causal_lm_loss_sum, token_count=causal_lm_tokens (parallel_layers.pipeline.hf); if every "
                "part holds as many labelled tokens, ignore this", UserWarning, stacklevel=4)

    def _dp_group(self):
        """The group the wrapper averages gradients over; None without one."""
        return self.module.group if isinstance(self.module, (ZeRO, DataParallel)) else None

    def _unscale(self) -> None:
        """With a loss scale, once a step: the gradients reduced and unscaled, and every rank told
        whether any overflowed (Note [one loss scale for every rank])."""
        if self.loss_scale is None or self._overflowed is not None:
            return
        if isinstance(self.module, ZeRO):  # stage 1 (and no_sync) reduce at the step: the shards' gradients first
            self.module.reduce_gradients()
        self._overflowed = self.loss_scale.unscale_(self.optimizer)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip by the global norm over every axis (tp, pp, the dp shards); call after backward."""
        self._unscale()
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(max_norm, tp_group=self.ctx.tp_group)
        if isinstance(self.module, ZeRO):
            return self.module.clip_grad_norm_(max_norm, tp_group=self.ctx.tp_group)
        if isinstance(self.module, DataParallel):
            return clip_grad_norm_(self.module.module, max_norm, data_parallel=self.module, tp_group=self.ctx.tp_group)
        return clip_grad_norm_(self.module, max_norm, tp_group=self.ctx.tp_group)

    def step(self) -> None:
        """The optimizer step (ZeRO: on the shards, then the parameters are all-gathered)."""
        self._refuse_parameters_added_later()
        self._checked = False  # the next step's first forward_backward looks again
        if self.loss_scale is not None:
            self._unscale()
            overflowed, self._overflowed = self._overflowed, None
            self.loss_scale.update(overflowed)
            if overflowed:  # every rank skips it (Note [one loss scale for every rank])
                if isinstance(self.module, ZeRO):
                    self.module.skip_step()
                return
        if not isinstance(self.module, ZeRO) and not self._stepped:  # ZeRO.step checks its own
            _optimizer.check_state_has_storage(self.optimizer, "parallelize(...).step")
            self._stepped = True
        (self.module if isinstance(self.module, ZeRO) else self.optimizer).step()

    # Note [parameters added after parallelize]: the optimizer, DataParallel's gradient buckets
    # and ZeRO's units are built over the parameters the model has when parallelize runs. One
    # added later - peft's LoRA adapters applied to the parallelized model, a layer replaced,
    # resize_token_embeddings (a new head, and the embedding's own parameter given new data of
    # another shape), a cast - gets a gradient that nothing averages over dp and nothing steps,
    # or that the buckets and masters no longer fit: adapters never trained, and the base they
    # froze did not either, silently (review findings, helpers 47, 50 and 51). Once a step - at
    # its first forward_backward, or at step() if none ran - every trainable parameter of the
    # model as the user holds it must carry the mark parallelize left on it, its shape and dtype
    # then (an attribute, which meta.swap_in keeps when it gives a parameter storage in place;
    # a first version kept ids, which a new parameter can reuse, and a weak reference stops
    # torch.utils.swap_tensors). Every rank holds all of the model (a pipeline rank the other
    # stages' modules as placeholders, where peft adds its adapters too), so every rank finds
    # the same ones and raises, with no collective. Cost: one walk of the module tree a step (~0.5 ms on a 32-layer
    # Llama's 423 modules on this project's CPU, under load), and nothing in further
    # accumulation microbatches.
    def _refuse_parameters_added_later(self) -> None:
        if self._checked:
            return
        if all(_as_built(p) for m in self._model.modules() for p in m._parameters.values()
               if p is not None and p.requires_grad):
            self._checked = True
            return
        added = [n for n, p in self._model.named_parameters() if p.requires_grad and not _as_built(p)]
        raise RuntimeError(
            f"parallelize: {len(added)} trainable parameter(s) were not in the model, or not of their shape and "
            f"dtype, when it was parallelized (e.g. {added[:3]}): no optimizer state, gradient averaging over "
            f"data-parallel ranks or ZeRO shard holds them, so they would never train. Add them before "
            f"parallelize - apply peft.get_peft_model(model, config), replace layers, resize embeddings, cast the "
            f"model first - and build the optimizer in the factory parallelize calls")

    def zero_grad(self) -> None:
        if isinstance(self.module, ZeRO):
            self.module.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)


def _mark_built(p: nn.Parameter) -> None:
    """Mark a parameter as parallelize built the layout over it (Note [parameters added after
    parallelize])."""
    p._pl_built_as = (p.shape, p.dtype)


def _as_built(p: nn.Parameter) -> bool:
    return getattr(p, "_pl_built_as", None) == (p.shape, p.dtype)


def declared_blocks(model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """The blocks a Hugging Face model declares: the classes it names in `_no_split_modules`
    (its decoder layers), the unit accelerate's FSDP auto-wrap and `device_map` placement keep
    whole, the outermost of them where they nest (MBart lists its attention beside its decoder
    layer; checkpointed blocks must not nest); None for a model that declares none."""
    names = frozenset(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return None
    inner: set[int] = set()  # declared modules inside another declared one

    def visit(module: nn.Module, inside: bool) -> None:
        for child in module.children():
            declared = type(child).__name__ in names
            if declared and inside:
                inner.add(id(child))
            visit(child, inside or declared)

    visit(model, False)
    return lambda m: type(m).__name__ in names and id(m) not in inner


# Note [mixed precision by the parameters]: FSDP2's mixed precision is a property of the
# parameters, not of the ops: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
# over a float32 model casts every parameter to bfloat16 as it gathers it, so the whole forward
# and backward run in bfloat16, and the gradients are reduced in float32 into float32 shards
# that the optimizer steps. ZeRO has had the same (`ZeRO(param_dtype=)`: the full parameter is
# cast once, the masters stay float32, each step's gather is in param_dtype); `param_dtype=`
# hands it to parallelize. Against loading the model in bfloat16 (ZeRO's float32 masters of
# what trains, the same arithmetic for a full fine-tune) it differs where the model holds
# float32 parameters of its own: peft's adapters on a bfloat16 base are float32
# (autocast_adapter_dtype), so peft casts each adapter's input to float32 and runs the adapter
# there - under param_dtype they compute in bfloat16, as under FSDP2's policy; and a frozen
# float32 base keeps float32 shards (half the saving of a bfloat16 base) but is gathered in
# bfloat16. Buffers keep their dtype (rotary's inv_freq), as under FSDP2. Only ZeRO gathers its
# parameters: without it (DataParallel, tensor or pipeline parallelism alone) the dtype of the
# compute is the model's or autocast's, so param_dtype is refused there.
def parallelize(model: nn.Module, ctx: ParallelContext, *, optimizer: Callable[[list], torch.optim.Optimizer],
                loss_fn: Callable[[Tensor, Tensor], Tensor], tp_plan: dict | str | None = None,
                sequence_parallel: bool = False,
                activation_checkpointing: str | None = None, zero_stage: int = 0,
                wrap: Callable[[nn.Module], bool] | None = None, pipeline_layers: str | None = None,
                schedule: str = "1f1b", microbatches: int | None = None, virtual: int | None = None,
                split_points: list[int] | None = None, fused_kernels: bool = True,
                token_count: Callable[[Tensor], Tensor] | None = None, expert_parallel: bool | int = False,
                loss_scale: str | float | None = None, offload_optimizer: bool = False,
                param_dtype: torch.dtype | None = None) -> Parallelized:
    """Parallelize `model` over `ctx`'s mesh in the order of Note [parallelize order].

    optimizer: factory from a list of parameters to a torch.optim optimizer. loss_fn(output,
    targets) -> the batch mean; or, with token_count(targets) -> how many items it sums, the
    sum, divided by the whole batch's count, over the microbatches and the dp replicas (exact
    for parts of unequal counts, e.g. padded batches: pipeline.hf.causal_lm_loss_sum with
    causal_lm_tokens; Note [token mean over data parallelism]). tp_plan: module-name pattern -> style, as for
    `tensor_parallel.parallelize`; "auto": the plan a Hugging Face model publishes; None: no
    conversion (the model is used as built). activation_checkpointing: None, "full" or
    "selective", per block: the modules `wrap` selects (parallel_layers/activation_checkpointing.py).
    zero_stage: 0 for DataParallel replicas, 1-3 for ZeRO over dp; wrap: ZeRO's parameter groups
    (and the blocks to checkpoint); by default, for a Hugging Face model, its decoder layers
    (`declared_blocks`). pipeline_layers: name of the model's attribute holding its
    layer list (dotted), or "auto" for a Hugging Face causal LM (with
    loss_fn=parallel_layers.pipeline.hf.causal_lm_loss); schedule, microbatches (default 2 * pp with a
    pipeline, else 1), virtual stages per rank (default 2 for "interleaved", else 1) and
    split_points are those of PipelineStages / PipelineParallel. sequence_parallel: with a
    tp_plan on a Hugging Face decoder, its activations between the TP regions are split on the
    sequence (tensor_parallel/hf_sequence_parallel.py); with a pipeline or microbatches, only with
    pipeline_layers="auto" (Note [sequence parallelism across stages] in pipeline/hf.py). fused_kernels: a
    Hugging Face decoder's SwiGLU MLPs run as one GEMM with the activation fused, its RMSNorms as
    one pass, its attention residual add inside the next norm, over the same parameters
    (parallel_layers/fused.py); False keeps the model's own modules and forwards.
    expert_parallel: True spreads a mixture of experts' experts over the dp ranks (E / dp each),
    every rank's tokens sent to their experts' ranks and back by all-to-all
    (parallel_layers/expert_parallel.py); a number ep dividing dp spreads them over groups of ep
    consecutive dp ranks (E / ep each), replicated over the dp / ep groups; False or 1: none.
    With DataParallel or ZeRO, pipelines, and tensor parallelism (each expert split over tp by
    the plan's Experts()). loss_scale: float16 training's, agreed by every rank (Note [one loss
    scale for every rank] in _loss_scale.py): "dynamic" (torch.amp.GradScaler's rule) or a static
    number; forward_backward scales the loss, clip_grad_norm_ / step unscale the gradients, and
    step skips the optimizer on every rank when any rank's overflowed. None: no scaling.
    offload_optimizer: with ZeRO (zero_stage 1-3), its master shards, their gradients and the
    optimizer state live in host memory and the optimizer steps there (ZeRO-Offload; ZeRO's
    offload_optimizer, parallel_layers/zero/api.py).
    param_dtype: with ZeRO, the dtype its full parameters are gathered and computed in (typically
    torch.bfloat16 or torch.float16; float32 master shards, gradients added and reduced in float32): FSDP2's
    MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32) over a float32 model, frozen
    parameters and peft's adapters included (Note [mixed precision by the parameters]). None: each
    parameter's own dtype.
    """
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"parallelize(model, ctx, ...) composes every kind of parallelism over the ParallelContext of "
                        f"init_parallel(); got {type(ctx).__name__} for ctx. For tensor parallelism alone with a "
                        "plan, call parallel_layers.tensor_parallel.parallelize(model, plan, tp_group=...)")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0 (DataParallel), 1, 2 or 3 (ZeRO stage), got {zero_stage!r}")
    if offload_optimizer and not zero_stage:
        raise ValueError("parallelize: offload_optimizer=True moves ZeRO's optimizer shards to host memory; it needs "
                         f"zero_stage 1, 2 or 3, got zero_stage={zero_stage!r} (DataParallel keeps the whole optimizer "
                         "on the device)")
    if getattr(model, "_pl_parallelized", None) is not None:  # every rank ran the first call: every rank raises
        raise ValueError(f"parallelize: this {type(model).__name__} was already parallelized ({model._pl_parallelized}); "
                         "its layers are sharded or wrapped, and ZeRO-3 has freed its full parameters. Build the model "
                         "again (its constructor, or from_pretrained) to parallelize it another way")
    if isinstance(tp_plan, str) and tp_plan != "auto":
        raise ValueError(f"parallelize: tp_plan must be 'auto' (the plan the model publishes), a dict of module-name "
                         f"pattern -> style, or None (no tensor parallelism); got {tp_plan!r}")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError(f"parallelize: optimizer must be a factory that builds the optimizer from the parameters it is "
                        f"given (e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)), got "
                        f"{type(optimizer).__name__}: tensor parallelism and ZeRO replace the model's parameters, so "
                        "an optimizer built before parallelize would step tensors nothing reads any more")
    if token_count is not None and not callable(token_count):  # else it would raise on the last stage only
        raise TypeError(f"token_count must be None or a function of the targets returning how many items loss_fn "
                        f"sums (e.g. pipeline.hf.causal_lm_tokens), got {type(token_count).__name__}")
    if param_dtype is not None:  # Note [mixed precision by the parameters]
        check_dtypes(param_dtype, torch.float32)
        if not zero_stage:
            raise ValueError(f"parallelize: param_dtype={param_dtype} casts the parameters ZeRO gathers (FSDP2's "
                             f"MixedPrecisionPolicy); it needs zero_stage 1, 2 or 3, got zero_stage={zero_stage!r}. "
                             "Without ZeRO, run forward_backward under torch.autocast(device, dtype) (DDP's mixed "
                             "precision) or load the model in that dtype")
    scaler = LossScale.from_argument(loss_scale)
    if zero_stage:  # the whole model, before anything is converted: after a pipeline's cut each rank
        refuse_non_floating(model)  # would see its own stages only (review finding)
    halves = [n for n, p in model.named_parameters() if p.dtype == torch.float16 and p.requires_grad] \
        if scaler is not None and not zero_stage else []
    if halves:
        raise ValueError(f"parallelize: loss_scale with float16 parameters that the optimizer steps directly (e.g. "
                         f"{halves[:2]}, {len(halves)} in all): their unscaled gradients and updates round in "
                         f"float16, which torch.amp.GradScaler refuses too ('Attempting to unscale FP16 gradients'). "
                         f"Keep the model in float32 and run forward_backward under torch.autocast(device, "
                         f"torch.float16), or use ZeRO (zero_stage 1-3), which steps float32 master shards")
    ep = expert_parallel_module.degree(expert_parallel, ctx.dims.dp)
    user_wrap, wrap = wrap, wrap if wrap is not None else declared_blocks(model)
    activation_checkpointing_module.check_arguments(activation_checkpointing, wrap)
    pp = ctx.dims.pp
    microbatches = microbatches if microbatches is not None else (2 * pp if pp > 1 else 1)
    virtual = virtual if virtual is not None else (2 if schedule == "interleaved" else 1)
    pipelined = pp > 1 or microbatches > 1 or pipeline_layers == "auto"
    if pipelined and pipeline_layers is None:
        raise ValueError(f"a pipeline (pp={pp}, microbatches={microbatches}) needs pipeline_layers=, the name of the "
                         "model's attribute holding its list of layers (e.g. 'layers')")
    if sequence_parallel and (tp_plan is None or (pipelined and pipeline_layers != "auto")):
        # with a pipeline, the stage boundaries carry the split hidden states and the Hugging Face
        # pipeline layers rebuild positions and the mask for the whole sequence (Note [sequence
        # parallelism across stages] in pipeline/hf.py); a layer list of the user's own knows nothing of it
        raise ValueError(f"parallelize: sequence_parallel=True needs tp_plan= (it splits the sequence between the "
                         f"tensor-parallel regions), and with a pipeline (pp > 1 or microbatches > 1) a Hugging Face "
                         f"decoder cut by pipeline_layers='auto'; got {'no' if tp_plan is None else 'a'} tp_plan, "
                         f"pp={pp}, microbatches={microbatches}, pipeline_layers={pipeline_layers!r}")
    originals = {id(p) for p in model.parameters()}  # what an optimizer built before would step
    asked = expert_parallel is True or ep > 1
    experts = [name for name, _ in expert_parallel_module.check(model, ep, expert_parallel)] if asked else []

    # 1. tensor parallelism, and the fused modules (after it: they take its layers' shards);
    #    expert parallelism
    if tp_plan is not None:
        tp_plan_module.parallelize(model, None if tp_plan == "auto" else tp_plan, tp_group=ctx.tp_group,
                                   sequence_parallel=sequence_parallel, fused_kernels=fused_kernels)
    elif fused_kernels:
        fused.fuse(model)
    if experts and ep > 1:  # on the whole model, before ranks drop other stages' layers
        expert_parallel_module.apply(model, ctx.mesh, experts, ep)
    # ZeRO's units: the blocks, and a Hugging Face model's vocabulary matrices (after step 1,
    # which may have replaced those modules; before the pipeline cut of step 3)
    zero_units = wrap if user_wrap is not None or wrap is None else vocabulary_units(model, wrap)
    # 2. activation checkpointing
    if activation_checkpointing is not None:
        activation_checkpointing_module.checkpoint_blocks(model, activation_checkpointing, wrap)
    # 3. this rank's pipeline stages, and the device (only the layers this rank holds move there)
    net, prefix = model, ""
    if pipelined:
        if pipeline_layers == "auto":  # a Hugging Face decoder's own modules, under its own names
            layers, named_after = hf_pipeline.decoder_layers(model), model
            if sequence_parallel:  # Note [sequence parallelism across stages] in pipeline/hf.py
                hf_pipeline.split_sequence(model, layers, ctx.tp_group)
        else:
            layers, named_after = operator.attrgetter(pipeline_layers)(model), None
        _check_layers_hold_every_parameter(model, layers, pipeline_layers)
        net = PipelineStages(layers, group=ctx.pp_group, virtual=virtual, split_points=split_points,
                             named_after=named_after, device=ctx.device)
        net.release_unheld(model)  # the other stages' layers: nothing of theirs stays alive here
        prefix = "" if named_after is not None else pipeline_layers + "."
    if not meta.has_meta(net):  # a meta-built model gets its storage later (parallel_layers/meta.py)
        net.to(ctx.device)
        fused.pack(net)  # the move gave every tensor storage of its own
    # 4. data parallelism over the dp axis, and the optimizer: the factory sees this rank's
    #    stages only, so it may fail on some ranks alone (a stage all frozen: "empty parameter
    #    list"): every rank raises it, no collective having run in between
    failed = None
    try:
        if zero_stage:
            wrapper = ZeRO(net, optimizer, stage=zero_stage, group=ctx.dp_group, wrap=zero_units,
                           offload_optimizer=offload_optimizer, param_dtype=param_dtype)
            opt = wrapper.optimizer  # ZeRO checked it against net's parameters; these were the model's before TP
            _optimizer.check(opt, [s for g in wrapper.groups for s in g.shards], "parallelize", replaced=originals)
        else:
            wrapper = DataParallel(net, group=ctx.dp_group) if ctx.dims.dp > 1 else None
            opt = _optimizer.build(optimizer, list(net.parameters()), "parallelize", replaced=originals)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        failed = e
    _raise_everywhere(failed, pipelined)
    if zero_stage and model is not net:  # the user's model holds the stages' layers: its zero_grad is ZeRO's
        route_zero_grad(model, wrapper)  # Note [zero_grad through the model] in zero/api.py
    model._pl_parallelized = (f"tp={ctx.dims.tp} pp={ctx.dims.pp} dp={ctx.dims.dp}, zero_stage={zero_stage}"
                              + (f", tp_plan={'auto' if tp_plan == 'auto' else 'a plan'}" if tp_plan is not None else ""))
    # 5. the pipeline schedule
    pipe = None
    if pipelined:
        pipe = PipelineParallel(net, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                                token_count=token_count, data_parallel=wrapper, device=ctx.device,
                                tp_group=ctx.tp_group if ctx.dims.tp > 1 else None)
    return Parallelized(module=wrapper if wrapper is not None else net, optimizer=opt, prefix=prefix, pipeline=pipe,
                        loss_fn=loss_fn, ctx=ctx, token_count=token_count, loss_scale=scaler, _model=model)


def _raise_everywhere(failed: Exception | None, pipelined: bool) -> None:
    """`failed` (this rank's error building the data-parallel wrapper and the optimizer), or
    another rank's, raised on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failed is not None:
            raise failed
        return
    errors = _dist.all_gather(_dist.describe_error(failed) if failed else None, None, "parallelize")
    if pipelined and any(e and "empty parameter list" in e for e in errors):
        raise ValueError("parallelize: a pipeline rank whose stages hold no trainable parameter (all frozen) gave the "
                         "optimizer factory nothing to step: build the optimizer over every parameter it is given "
                         "(frozen ones get no gradient and are not stepped), or freeze fewer layers. "
                         + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
    _dist.raise_if_any(errors, failed, "parallelize")


def _takes_use_cache(model: nn.Module) -> bool:
    """A transformers model's forward takes `use_cache`: by name, or - a transformers
    PreTrainedModel's (GraniteMoE's) - through **kwargs. A module of the user's own that merely
    keeps a config may not take it (review finding)."""
    if not hasattr(getattr(model, "config", None), "use_cache"):
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    transformers_model = any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                             for c in type(model).__mro__)
    return "use_cache" in params or (transformers_model and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))


def _innermost(module: nn.Module) -> nn.Module:
    """The model inside DataParallel / ZeRO (their `.module`)."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def vocabulary_units(model: nn.Module, blocks: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """ZeRO's units for a Hugging Face model by default (Note [vocabulary units]): its blocks,
    and, for a family whose forward we know, its input embedding and output head each a unit of
    its own when both exist and are not tied."""
    def get(name: str) -> nn.Module | None:
        fn = getattr(model, name, None)
        module = fn() if callable(fn) else None
        return module if isinstance(module, nn.Module) and any(True for _ in module.parameters()) else None

    embedding, head = get("get_input_embeddings"), get("get_output_embeddings")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if embedding is None or head is None or family not in hf_pipeline.SUPPORTED:
        return blocks
    if {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}:  # tied
        return blocks
    units = {id(embedding), id(head)}
    return lambda m: blocks(m) or id(m) in units


# Note [vocabulary units]: with the default `wrap`, ZeRO's units for a Hugging Face model are
# its declared blocks (the decoder layers) and, untied, the input embedding and the output
# head, each its own unit, as torchtitan shards its token embeddings and output layer apart from
# the blocks. Left in the root group they would stay gathered for the whole step at stage 3,
# gradients included: vocab x hidden twice, on every rank. On a Llama-3-8B (a vocabulary of
# 128256 at hidden 4096) that is 1.05B parameters, an eighth of the model, held whole where
# everything else is divided by dp. As units they are gathered for their forward and backward
# only (the head, whose forward runs last, stays gathered into backward: Note [last group stays
# gathered] in zero/_hooks.py) and their gradients are reduce-scattered as soon as backward has
# made them, the head's first of all. A tied pair shares one weight, which the root keeps
# gathered for the whole forward (Note [shared parameters] in zero/api.py). Activation
# checkpointing still takes the blocks alone. Only for the families whose forwards we have read
# (pipeline/hf.py's SUPPORTED, the ones `pipeline_layers="auto"` cuts): there the embedding's
# weight is read by its lookup alone and the head's by the head. Other code reads the embedding
# where ZeRO-3 would have freed it (a head without a module of its own, `F.linear(h,
# embed.weight)`; a self-conditioning term: transformers' DiffusionGemma), and a model without
# a head module may tie that way: those keep both matrices in the root, as before.


def _check_layers_hold_every_parameter(model: nn.Module, layers, name: str) -> None:
    """A parameter outside the layer list would be trained by no stage and missing from checkpoints."""
    if not isinstance(layers, (nn.ModuleList, nn.Sequential, list, tuple)):
        raise TypeError(f"parallelize: pipeline_layers={name!r} must name a list of layers (nn.ModuleList, "
                        f"nn.Sequential), got {type(layers).__name__}")
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(f"parallelize: pipeline_layers={name!r} must hold every parameter of "
                         f"{type(model).__name__}, but {outside[:3]}{' ...' if len(outside) > 3 else ''} are outside "
                         "it; make them part of a layer (e.g. the embedding's or the head's)")
