"""``zero0``..``zero3``: DeepSpeed ZeRO (see :mod:`.strategy`)."""
from parallel_lab.strategies.zero.strategy import ZeroStrategy

__all__ = ["ZeroStrategy"]
