"""Pipeline parallelism: cut a model into stages, schedule microbatches through them.

  schedule.py  per-rank action lists (gpipe, 1f1b, interleaved), validated by simulation
  stages.py    PipelineStages: split a layer list (balanced or at given points), tied weights
  _p2p.py      activation / gradient messages between stages, with the shape contract
  runtime.py   PipelineParallel: run a step's actions, reduce gradients once at the end
"""

from parallel_layers.pipeline.runtime import PipelineParallel
from parallel_layers.pipeline.schedule import SCHEDULES, Action, ScheduleError, build_schedule, validate
from parallel_layers.pipeline.stages import PipelineStages, balanced_split

__all__ = ["SCHEDULES", "Action", "PipelineParallel", "PipelineStages", "ScheduleError", "balanced_split",
           "build_schedule", "validate"]
