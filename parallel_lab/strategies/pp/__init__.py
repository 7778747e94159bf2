"""``pp``: pipeline parallelism. ``rules`` holds its options and parent-side rules (torch-free),
``plan`` cuts the model into stages, ``schedules`` orders each stage's forwards and backwards,
``strategy`` runs them (send/recv, or torch.distributed.pipelining)."""

from parallel_lab.strategies.pp import rules  # noqa: F401  (registers pp's rules)


def load_runtime() -> None:
    """Import the modules that register pp's runtime classes (torch; strategies/__init__.py)."""
    from parallel_lab.strategies.pp import ds_pipe, strategy  # noqa: F401  (ds_pipe: strategy.impl=deepspeed)
