"""``fsdp``: Fully Sharded Data Parallel. ``strategy`` holds what both torch APIs share (options,
checkpoints through DCP, memory accounting); ``v2`` (``fully_shard``, the default) and ``v1``
(the ``FullyShardedDataParallel`` wrapper, ``strategy.version=1``) are one small class each."""

from parallel_lab.strategies.fsdp.strategy import FSDPStrategy
from parallel_lab.strategies.fsdp.v1 import FSDP1
from parallel_lab.strategies.fsdp.v2 import FSDP2

__all__ = ["FSDP1", "FSDP2", "FSDPStrategy"]
