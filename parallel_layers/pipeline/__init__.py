"""Pipeline parallelism: cut a model into stages, schedule microbatches through them.

  schedule.py  per-rank action lists (gpipe, 1f1b, interleaved): computes and batched
               sends/receives, checked against NCCL's point-to-point rules by simulation
  stages.py    PipelineStages: split a layer list (balanced or at given points), tied weights
  _p2p.py      one batch_isend_irecv per schedule batch, with the stage boundary contract
  runtime.py   PipelineParallel: run a step's actions, reduce gradients once at the end
  hf.py        decoder_layers(model): an unmodified Hugging Face causal LM's own modules as the
               layer list (pipeline_layers="auto" of parallelize), and its causal_lm_loss
"""

from parallel_layers.pipeline.runtime import PipelineParallel
from parallel_layers.pipeline.schedule import SCHEDULES, Action, Batch, ScheduleError, build_schedule, validate
from parallel_layers.pipeline.stages import PipelineStages, balanced_split

__all__ = ["SCHEDULES", "Action", "Batch", "PipelineParallel", "PipelineStages", "ScheduleError", "balanced_split",
           "build_schedule", "validate"]
