"""A strategy that does not say where its model state lives is refused when it registers
(in-process). A whole plugin strategy through the sweep, the report and the bench:
tests/integration/test_plugins.py."""

from __future__ import annotations

import pytest


def test_a_strategy_that_does_not_say_where_its_state_lives_is_refused():
    from parallel_lab.strategies import register, registered_names
    from parallel_lab.strategies.base import Strategy

    with pytest.raises(
        TypeError,
        match=r"define State.save, State.load, State.full_parameters, Memory.after_backward, Memory.after_step, "
        r"Memory.analytic \(its State and Memory parts\)",
    ):

        @register("forgetful")
        class Forgetful(Strategy):  # shards nothing explicitly, inherits no state hooks
            pass

    assert "forgetful" not in registered_names()


def test_a_strategy_that_says_where_its_state_lives_but_not_what_it_holds_is_refused():
    """Its State is given (replicated), its Memory is not: only the accounting is asked for."""
    from parallel_lab.strategies import register, registered_names
    from parallel_lab.strategies.base import Strategy
    from parallel_lab.strategies.replicated import ReplicatedState

    with pytest.raises(
        TypeError, match=r"define Memory.after_backward, Memory.after_step, Memory.analytic \("
    ) as caught:

        @register("unaccounted")
        class Unaccounted(Strategy):
            State = ReplicatedState

    assert "State.save" not in str(caught.value)
    assert "unaccounted" not in registered_names()
