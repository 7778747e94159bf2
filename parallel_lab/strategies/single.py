"""``single``: one process, no communication. The baseline every other row is checked against
(in bf16, ``strategy.precision=bf16``, the baseline of the bf16 rows: ``strategies/precision.py``).
Its options and rules: ``replicated_rules.py``."""

from parallel_lab.strategies.base import Strategy
from parallel_lab.strategies.precision import Bf16Compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import ReplicatedMemory, ReplicatedState
from parallel_lab.strategies.replicated_rules import SinglePlan


@register("single")
class SingleStrategy(Bf16Compute, Strategy):
    plan = SinglePlan
    State = ReplicatedState
    Memory = ReplicatedMemory
