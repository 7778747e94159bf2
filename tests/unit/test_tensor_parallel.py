"""Tensor parallelism (strategy=tp): bad input is one config error, refused in the parent,
in-process. The strategy on real ranks: tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from tests.support.model_parallel import assert_one_line_config_error


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy.tp=3", "world_size=3", "strategy.split_conv=true"], ["strategy.tp=3", "32", "block1.0"]),
        (["strategy.tp=4", "world_size=2"], ["strategy.tp=4", "world_size=2"]),
        (["strategy.impl=megatron"], ["strategy.impl=megatron"]),
        (["strategy.impl=dtensor", "strategy.split_conv=true"], ["strategy.split_conv=true"]),
    ],
)
def test_tp_bad_input_is_one_config_error(overrides, named):
    assert_one_line_config_error("tp", overrides, named)
