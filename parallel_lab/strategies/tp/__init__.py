"""``tp``: Megatron-style tensor parallelism (see :mod:`.strategy`; its f/g collectives in :mod:`.comm`)."""
from parallel_lab.strategies.tp.strategy import ColumnParallel, RowParallel, TensorParallelStrategy

__all__ = ["ColumnParallel", "RowParallel", "TensorParallelStrategy"]
