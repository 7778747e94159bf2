"""``fsdp``: Fully Sharded Data Parallel (see :mod:`.strategy`)."""
from parallel_lab.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
