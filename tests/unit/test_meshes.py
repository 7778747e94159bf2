"""2-D device meshes: bad degrees are one config error, refused in the parent (in-process). The
layouts trained on real ranks: tests/integration/test_meshes.py."""

from __future__ import annotations

import pytest

from tests.support.model_parallel import assert_one_line_config_error


@pytest.mark.parametrize(
    "strategy, overrides, named",
    [
        ("fsdp", ["strategy.sharding=hybrid", "world_size=4"], ["strategy.sharding=hybrid", "strategy.replicate=2"]),
        (
            "fsdp",
            ["strategy.sharding=hybrid", "strategy.replicate=3", "world_size=4"],
            ["strategy.replicate=3", "world_size=4"],
        ),
        ("fsdp", ["strategy.sharding=hybrid", "strategy.replicate=2", "strategy.version=1"], ["strategy.version=2"]),
        ("fsdp", ["strategy.replicate=2", "world_size=4"], ["strategy.replicate=2", "strategy.sharding=hybrid"]),
        ("tp", ["strategy.replicate=2", "world_size=2"], ["strategy.replicate=2 x strategy.tp=2 = 4", "world_size=2"]),
        ("tp", ["strategy.replicate=0", "world_size=2"], ["strategy.replicate=0"]),
        (
            "pp",
            ["strategy.replicate=2", "world_size=6"],
            ["strategy.replicate=2 x strategy.stages=2 = 4", "strategy.replicate=3"],
        ),
    ],
)
def test_mesh_degrees_are_one_config_error(strategy, overrides, named):
    assert_one_line_config_error(strategy, overrides, named)
