"""``single``: one process, no communication. The baseline every other row is checked against
(in bf16, ``strategy.precision=bf16``, the baseline of the bf16 rows: ``strategies/precision.py``)."""

from dataclasses import dataclass

from parallel_lab.choices import Precision
from parallel_lab.strategies.base import Strategy, StrategyOptions
from parallel_lab.strategies.precision import Bf16Compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import OneProcessPlan, ReplicatedMemory, ReplicatedState


@dataclass
class SingleOptions(StrategyOptions):
    """``strategy=single`` options."""

    # fp32 | bf16: forward/backward on a bf16 copy of the fp32 weights (strategies/precision.py)
    precision: Precision = Precision.fp32


@register("single")
class SingleStrategy(Bf16Compute, Strategy):
    Options = SingleOptions
    plan = OneProcessPlan
    State = ReplicatedState
    Memory = ReplicatedMemory
