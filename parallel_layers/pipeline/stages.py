"""Cut a model, given as a list of layers, into pipeline stages, and keep this rank's.

    stages = PipelineStages(layers, group=ctx.pp_group, virtual=1)          # balanced split
    stages = PipelineStages(layers, group=ctx.pp_group, split_points=[3, 7])  # stages start at layers 3, 7

`layers` is the model as a sequence of modules that each take one tensor and return one
(e.g. embedding, blocks..., final norm + head); the loss is applied to the last one's output
by the schedule. Every rank builds the same layer list (same seed, so the same weights) and
keeps the layers of its stages: stage k of S = p * v lives on rank k % p as its chunk k // p.

The balanced split minimises the largest stage's parameter count over contiguous splits,
counting every layer's parameters, embedding and head included (a tied head counts its
weight again: its matmul costs as much as an untied one).

Note [tied parameters]: a parameter used by layers of two stages on different ranks (an
embedding tied to the LM head) becomes one copy per rank. The copies start equal (broadcast
from the lowest stage's rank) and stay equal because their gradients are summed across the
ranks holding them before the optimizer step (`sync_tied_grads`), so every copy takes the
same step. Gradient-norm clipping counts a tied parameter once, on its lowest stage.

Note [tied gradients accumulate]: a step may start with gradients already there - several
`step`s (forward_backward calls) before one optimizer step, accumulating, or an evaluation
between. The tied copies' gradients were summed by the earlier step and are equal on every
copy; summed again, that part would count once per copy (a tied Llama at pp=2 accumulating two
batches: embedding 6.4e-3 off the plain model's after one SGD step, with no error). So each
step first divides what is there by the number of copies (exact for the usual two, the first
and last stage) and the sum gives it back once, plus every copy's new part
(`scale_tied_grads_before_step`).

Note [side inputs]: a layer may need, besides the activations, a per-microbatch tensor that
does not flow from the previous stage: the attention mask of a padded batch, the user's position
ids. A layer that declares `pipeline_side_inputs = ("attention_mask", "position_ids")` is called
as `layer(x, attention_mask=m, position_ids=p)` with those given this step; the runtime sends
each from pipeline rank 0 to every pipeline rank once per step (one broadcast of [batch, seq]
integers each) and gives each stage its microbatch's rows. They do not cross stage boundaries
and have no gradient. `side_inputs` is what the whole layer list takes, known on every rank, so
a side input no layer would read is refused everywhere.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers import _grad_bank, fault, placement
from parallel_layers.pipeline.schedule import check_arguments


class _Chunk(nn.Sequential):
    """One stage's layers in order; side inputs go to the layers that declare them (Note [side inputs])."""

    def forward(self, x: torch.Tensor, **side: torch.Tensor) -> torch.Tensor:
        for layer in self:
            wanted = getattr(layer, "pipeline_side_inputs", ())
            x = layer(x, **{k: v for k, v in side.items() if k in wanted}) if wanted else layer(x)
        return x


def _layer_params(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def balanced_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Start indices of `parts` contiguous, non-empty groups of `sizes` minimising the largest sum."""
    n = len(sizes)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: every stage needs at least one layer; "
                         f"use at most {n} stages (pp * virtual) or split the model into more layers")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[j][i]: the smallest possible largest sum cutting the first i layers into j groups.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for start in range(j - 1, i):
                cost = max(best[j - 1][start], prefix[i] - prefix[start])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, start
    starts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def stage_bounds(layers: Sequence[nn.Module], stages: int, split_points: Sequence[int] | None) -> list[tuple[int, int]]:
    """[start, end) layer indices of each stage."""
    n = len(layers)
    if split_points is None:
        starts = balanced_split([_layer_params(m) for m in layers], stages)
    else:
        points = list(split_points)
        if len(points) != stages - 1:
            raise ValueError(f"split_points must give the first layer of stages 1..{stages - 1} ({stages - 1} indices "
                             f"for {stages} stages), got {len(points)}: {points}")
        if any(not isinstance(x, int) for x in points) or points != sorted(set(points)) or \
                (points and (points[0] < 1 or points[-1] > n - 1)):
            raise ValueError(f"split_points must be strictly increasing layer indices in [1, {n - 1}] (the model has "
                             f"{n} layers), got {points}")
        starts = [0] + points
    return [(s, e) for s, e in zip(starts, starts[1:] + [n])]


class PipelineStages(nn.Module):
    """This rank's pipeline stages (chunks), in the order of their stage index."""

    def __init__(self, layers: Sequence[nn.Module], *, group: dist.ProcessGroup | None = None, virtual: int = 1,
                 split_points: Sequence[int] | None = None, named_after: nn.Module | None = None,
                 device: torch.device | str | None = None):
        """named_after: the model whose state_dict keys the layers' own keys already are (the
        Hugging Face adapters of pipeline/hf.py mount its modules at their paths); the stages'
        tensors then keep those names (Note [pipeline names]), and exporters (hf.save_pretrained)
        find the model here, for its config and class. It is not registered as a submodule.
        device: move this rank's layers there before the tied copies are synchronised (the
        other ranks' layers stay where they are: see `release_unheld`)."""
        super().__init__()
        layers = list(layers)
        self.__dict__["named_after"] = named_after  # plain attribute: its parameters are not the stages'
        # The first layer may refuse inputs it cannot take (pipeline/hf.py's embedding: token ids
        # [batch, seq]); every rank keeps the check, so that the runtime's batch check raises it on all.
        self.input_problem = getattr(layers[0], "pipeline_input_problem", None) if layers else None
        # and the token ids it takes (Note [token ids in range] in parallel_layers/_token_ids.py)
        self.input_vocab = getattr(layers[0], "pipeline_vocab_size", None) if layers else None
        self.group = group
        self.ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        check_arguments("interleaved" if virtual > 1 else "1f1b", self.ranks, 1, virtual)
        self.virtual = virtual
        self.num_stages = self.ranks * virtual
        self.bounds = stage_bounds(layers, self.num_stages, split_points)
        self.stage_ids = list(range(self.rank, self.num_stages, self.ranks))
        self.chunks = nn.ModuleList(_Chunk(*layers[s:e]) for s, e in (self.bounds[k] for k in self.stage_ids))
        self.side_inputs = frozenset(n for layer in layers for n in getattr(layer, "pipeline_side_inputs", ()))
        if device is not None and not any(t.is_meta for t in itertools.chain(self.parameters(), self.buffers())):
            self.chunks.to(device)
        self._ties = self._find_ties(layers)
        # every key a tied weight has in the layer list, (layer index, key within the layer): the
        # aliases of its copy here (a checkpoint written without a pipeline holds its optimizer
        # state under one of them only)
        self._tie_keys = {id(p): [(i, key) for i, layer in enumerate(layers)
                                  for key, q in layer.named_parameters(remove_duplicate=False) if q is p]
                          for p, _, _ in self._ties}

    def chunk(self, stage: int) -> nn.Module:
        return self.chunks[stage // self.ranks]

    def forward(self, x: torch.Tensor, **side: torch.Tensor) -> torch.Tensor:
        """Run this rank's stages in order (only meaningful when it holds them all: p = 1)."""
        for c in self.chunks:
            x = c(x, **side)
        return x

    def release_unheld(self, model: nn.Module) -> int:
        """Free the storage of `model`'s tensors that no stage of this rank holds (the layers of
        the other ranks' stages), so that a model built whole (from_pretrained) keeps only this
        rank's part alive: each becomes a meta tensor of its shape, in the modules that are not
        this rank's (a tensor shared with a held module, a tied weight, is kept). Returns the
        number of elements freed. As torchtitan deletes the modules a stage does not own."""
        held = {id(t) for t in itertools.chain(self.parameters(), self.buffers())}
        freed = 0
        for name, module in model.named_modules():
            unheld = False
            for table in (module._parameters, module._buffers):
                for key, t in table.items():
                    if t is None or id(t) in held:
                        continue
                    unheld = True
                    if t.is_meta:
                        continue
                    freed += t.numel()
                    empty = t.detach().to("meta")
                    table[key] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else empty
            if unheld:
                module.register_forward_pre_hook(self._refuse_unheld(name or type(model).__name__))
        return freed

    def _refuse_unheld(self, name: str):
        """Note [a module another rank holds]: the modules of the other ranks' stages keep meta
        tensors here, and torch runs some ops on them without complaint (F.linear of a CPU input
        and a meta weight returns an uninitialised CPU tensor): the user's model called whole on
        a pipeline rank - generate(), a forward of their own - computed garbage silently. A call
        into such a module raises instead, on every pipeline rank (each holds a part only)."""
        held = ", ".join(f"stage {k} (pipeline layers {self.bounds[k][0]}-{self.bounds[k][1] - 1}: "
                         f"{', '.join(_label(layer) for layer in self.chunk(k).children())})" for k in self.stage_ids)

        def hook(module, args):
            raise RuntimeError(
                f"{name} ({type(module).__name__}) belongs to another pipeline rank's stage: pipeline rank "
                f"{self.rank} of {self.ranks} holds {held} of the {self.num_stages} stages over "
                f"{self.bounds[-1][1]} pipeline layers; the others' tensors are meta placeholders here, so the "
                f"model cannot run whole on "
                f"this rank. Train and evaluate through the pipeline (forward_backward, evaluate); for generate() "
                f"or a forward of the whole model, export it (parallel_layers.hf.save_pretrained(par, directory)) "
                f"and load it in one process, or parallelize without a pipeline (pp=1)")
        return hook

    # ---- tied parameters (Note [tied parameters]) ----------------------------------------
    def _find_ties(self, layers: list[nn.Module]) -> list[tuple[nn.Parameter, dist.ProcessGroup | None, bool]]:
        stage_of_layer = [k for k, (s, e) in enumerate(self.bounds) for _ in range(s, e)]
        holders: dict[int, list[int]] = {}  # id(param) -> stages using it
        params: dict[int, nn.Parameter] = {}
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                holders.setdefault(id(p), [])
                if stage_of_layer[i] not in holders[id(p)]:
                    holders[id(p)].append(stage_of_layer[i])
                params[id(p)] = p
        shared = [(params[pid], sorted({k % self.ranks for k in st})) for pid, st in holders.items()
                  if len({k % self.ranks for k in st}) > 1]
        if not shared or not dist.is_initialized():
            return []
        # Every rank creates every tie group, in the same order (new_group is collective over
        # the world): one group per pipeline (pp group) and tie.
        all_pp_groups: list = [None] * dist.get_world_size()
        with fault.collective("pipeline groups all_gather_object", None):
            dist.all_gather_object(all_pp_groups, dist.get_process_group_ranks(self.group) if self.group is not None
                                   else list(range(dist.get_world_size())))
        ties = []
        for pp_ranks in sorted({tuple(g) for g in all_pp_groups}):
            for p, pipeline_ranks in shared:
                members = [pp_ranks[r] for r in pipeline_ranks]
                tie_group = dist.new_group(members)
                if dist.get_rank() in members:
                    mine = pipeline_ranks.index(self.rank) if self.rank in pipeline_ranks else None
                    if mine is not None:
                        ties.append((p, tie_group, mine == 0))
        with torch.no_grad():
            for p, tie_group, _ in ties:
                with fault.collective("tied-parameter broadcast", tie_group):
                    dist.broadcast(p.data, src=dist.get_global_rank(tie_group, 0), group=tie_group)
        return ties

    def scale_tied_grads_before_step(self) -> None:
        """Divide the tied copies' gradients by the number of copies (Note [tied gradients accumulate])."""
        for p, tie_group, _ in self._ties:
            for grad in (p.grad, _grad_bank.banked(p)):
                if grad is not None:
                    grad.div_(dist.get_world_size(tie_group))

    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied parameters over the ranks holding a copy: the whole of each
        copy's, with what ZeRO banked of its earlier backward passes (Note [accumulating in the
        reduce dtype] in zero/_param.py), in the bank's dtype, then banked again."""
        for p, tie_group, _ in self._ties:
            if not p.requires_grad:  # frozen (on every copy alike): no gradient, as the plain model has none
                continue
            banks = _grad_bank.dtype_of(p) is not None  # the same on every copy: ZeRO's settings
            grad = _grad_bank.take(p) if banks else p.grad
            if grad is None:
                grad = torch.zeros_like(p, dtype=_grad_bank.dtype_of(p) if banks else None)
            fault.check_agreement("tied-parameter gradient all_reduce", grad, tie_group)
            with fault.collective("tied-parameter gradient all_reduce", tie_group):
                dist.all_reduce(grad, group=tie_group)
            if banks:
                _grad_bank.set_banked(p, grad)
            else:
                p.grad = grad

    def counted_once(self, p: nn.Parameter) -> bool:
        """False for the copies of a tied parameter that are not on its lowest stage's rank."""
        return all(q is not p or owner for q, _, owner in self._ties)

    # ---- state ---------------------------------------------------------------------------
    def state_placement(self, prefix: str = "") -> placement.ModelPlacement:
        """Note [pipeline names]: this rank's layers under the names of the layer list they were cut from:
        "chunks.<c>.<j>.<rest>" becomes prefix + "<i>.<rest>", i the layer's index in that list
        (prefix "layers." makes it the unparallelized model's key). With `named_after`, the layers'
        keys are already the model's own ("model.layers.3.mlp.up_proj.weight"): "<rest>" is kept,
        prefix + "<rest>". A tied weight's copies are all described; only the lowest stage's is
        `counted` (gradient norm)."""
        described = placement.describe_module(self)
        renamed, new_key = {}, {}
        for key, tp in described.tensors.items():
            _, chunk, j, rest = key.split(".", 3)
            tp.name = new_key[key] = self._key(self.bounds[self.stage_ids[int(chunk)]][0] + int(j), rest, prefix)
            tp.counted = self.counted_once(tp.local)
            renamed[tp.name] = tp
        for tp in renamed.values():  # a tied weight's other keys: on this rank, and on the other stages
            others = [new_key[a] for a in tp.aliases] + [self._key(i, rest, prefix)
                                                         for i, rest in self._tie_keys.get(id(tp.local), ())]
            tp.aliases = tuple(dict.fromkeys(k for k in others if k != tp.name))
        described.tensors = renamed
        return described

    def _key(self, layer: int, rest: str, prefix: str) -> str:
        """The name of key `rest` of layer `layer` (Note [pipeline names])."""
        return prefix + rest if self.named_after is not None else f"{prefix}{layer}.{rest}"


def _label(layer: nn.Module) -> str:
    """A pipeline layer as a user knows it: a Hugging Face decoder layer by its path in the model
    (pipeline/hf.py's adapters; pipeline layer 0 is the embedding there, so model.layers.1 is
    pipeline layer 2: review finding, helper-67), else its class."""
    path = getattr(layer, "path", None)
    if isinstance(path, str):
        return path
    names = {"Embedding": "the embedding", "Head": "the final norm and head"}
    return names.get(type(layer).__name__, type(layer).__name__) if type(layer).__module__.endswith("pipeline.hf") \
        else type(layer).__name__
