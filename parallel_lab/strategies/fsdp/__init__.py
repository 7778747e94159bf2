"""``fsdp``: Fully Sharded Data Parallel. ``strategy`` holds what both torch APIs share (options,
checkpoints through DCP, memory accounting); ``v2`` (``fully_shard``, the default) and ``v1``
(the ``FullyShardedDataParallel`` wrapper, ``strategy.version=1``) are one small class each."""

from parallel_lab.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
