"""``zero0``..``zero3``: DeepSpeed ZeRO. ``ds_config`` builds the DeepSpeed config from the Hydra
config, ``strategy`` trains with the engine; its checkpoints are read by
``parallel_lab.checkpoint.ds_reader``."""

from parallel_lab.strategies.zero.strategy import STAGES, ZeroStrategy, zero_name, zero_stage

__all__ = ["STAGES", "ZeroStrategy", "zero_name", "zero_stage"]
