"""``zero0``..``zero3``: DeepSpeed ZeRO. ``ds_config`` builds the DeepSpeed config from the Hydra
config, ``strategy`` trains with the engine, ``rules``/``state``/``memory`` are its parent-side
rules, checkpoints and memory accounting; its checkpoints are read by
``parallel_lab.checkpoint.ds_reader``."""

from parallel_lab.strategies.zero.rules import STAGES, zero_name, zero_stage
from parallel_lab.strategies.zero.strategy import ZeroStrategy

__all__ = ["STAGES", "ZeroStrategy", "zero_name", "zero_stage"]
