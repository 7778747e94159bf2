"""``tp``: Megatron-style tensor parallelism. ``comm`` holds its two conjugate collectives (f, g),
``layers`` the column/row-parallel modules built on them, ``strategy`` the split plan and training."""

from parallel_lab.strategies.tp import ds_autotp  # noqa: F401  (registers strategy.impl=deepspeed)
from parallel_lab.strategies.tp.layers import ColumnParallel, RowParallel
from parallel_lab.strategies.tp.strategy import TensorParallelStrategy

__all__ = ["ColumnParallel", "RowParallel", "TensorParallelStrategy"]
