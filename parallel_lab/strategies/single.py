"""``single``: one process, no communication. The baseline every other row is checked against."""

from parallel_lab.strategies import register
from parallel_lab.strategies.base import Strategy
from parallel_lab.strategies.replicated import ReplicatedModel


@register("single")
class SingleStrategy(ReplicatedModel, Strategy):
    """No options beyond the name."""

    single_process = True
    needs_process_group = False
    comm_theory_psi = 0.0
