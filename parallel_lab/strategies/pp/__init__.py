"""``pp``: pipeline parallelism (see :mod:`.strategy`)."""
from parallel_lab.strategies.pp.strategy import SCHEDULES, PipelineParallelStrategy, plan_stages

__all__ = ["SCHEDULES", "PipelineParallelStrategy", "plan_stages"]
