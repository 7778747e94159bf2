"""``zero0``..``zero3``: DeepSpeed ZeRO. ``rules`` holds its options and parent-side rules
(torch-free), ``ds_config`` builds the DeepSpeed config from the Hydra config, ``strategy`` trains
with the engine, ``state``/``memory`` its checkpoints and memory accounting; its checkpoints are
read by ``parallel_lab.checkpoint.ds_reader``."""

from parallel_lab.strategies.zero.rules import STAGES, zero_name, zero_stage

__all__ = ["STAGES", "zero_name", "zero_stage"]


def load_runtime() -> None:
    """Import the module that registers zero's runtime class (torch; strategies/__init__.py)."""
    from parallel_lab.strategies.zero import strategy  # noqa: F401
