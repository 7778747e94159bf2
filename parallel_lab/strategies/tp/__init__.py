"""``tp``: Megatron-style tensor parallelism. ``rules`` holds its options and parent-side rules
(torch-free), ``comm`` its two conjugate collectives (f, g), ``layers`` the column/row-parallel
modules built on them, ``strategy`` the split plan and training."""

from parallel_lab.strategies.tp import rules  # noqa: F401  (registers tp's rules)


def load_runtime() -> None:
    """Import the modules that register tp's runtime classes (torch; strategies/__init__.py)."""
    from parallel_lab.strategies.tp import ds_autotp, strategy  # noqa: F401  (ds_autotp: strategy.impl=deepspeed)
