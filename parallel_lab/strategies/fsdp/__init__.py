"""``fsdp``: Fully Sharded Data Parallel. ``rules`` holds its options and parent-side rules
(torch-free), ``strategy`` what both torch APIs share (checkpoints through DCP, memory accounting);
``v2`` (``fully_shard``, the default) and ``v1`` (the ``FullyShardedDataParallel`` wrapper,
``strategy.version=1``) are one small class each."""

from parallel_lab.strategies.fsdp import rules  # noqa: F401  (registers fsdp's rules)


def load_runtime() -> None:
    """Import the modules that register fsdp's runtime classes (torch; strategies/__init__.py)."""
    from parallel_lab.strategies.fsdp import strategy, v1, v2  # noqa: F401
