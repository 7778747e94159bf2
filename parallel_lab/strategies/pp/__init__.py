"""``pp``: pipeline parallelism. ``plan`` cuts the model into stages, ``schedules`` orders each
stage's forwards and backwards, ``strategy`` runs them (send/recv, or torch.distributed.pipelining)."""

from parallel_lab.strategies.pp import ds_pipe  # noqa: F401  (registers strategy.impl=deepspeed)
from parallel_lab.strategies.pp.plan import plan_stages
from parallel_lab.strategies.pp.schedules import SCHEDULES
from parallel_lab.strategies.pp.strategy import PipelineParallelStrategy

__all__ = ["SCHEDULES", "PipelineParallelStrategy", "plan_stages"]
