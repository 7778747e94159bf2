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


HSDP = ["strategy.sharding=hybrid", "model=vit", "model.moe_experts=4", "model.moe_topk=2"]


@pytest.mark.parametrize(
    "overrides, named",
    [
        # ep borrows the shard ranks (torchtitan): dividing the data-parallel size 4 is not enough
        (["strategy.replicate=2", "strategy.ep=4", "world_size=4"], ["strategy.ep=4", "shard group size 2"]),
        (["strategy.replicate=4", "strategy.ep=2", "world_size=4"], ["strategy.ep=2", "shard group size 1"]),
        (["strategy.replicate=2", "strategy.ep=3", "world_size=6"], ["strategy.ep=3", "model.moe_experts=4"]),
        (["strategy.replicate=2", "strategy.ep=2", "world_size=4", "strategy.version=1"], ["strategy.version=2"]),
    ],
)
def test_hsdp_ep_degrees_are_one_config_error(overrides, named):
    assert_one_line_config_error("fsdp", [*HSDP, *overrides], named)


@pytest.mark.parametrize(
    "world, replicate, ep_groups, replicas",
    [
        (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
        (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ],
)
def test_hsdp_ep_groups_lie_inside_the_shard_groups(world, replicate, ep_groups, replicas):
    """An accepted HSDP x ep config: each ep group (the all-to-all's ranks) inside one shard group
    (a host's consecutive ranks), each expert's replicas one rank of every ep group."""
    from parallel_lab.strategies.ep.groups import all_groups, ep_group_ranks, replica_ranks
    from parallel_lab.strategies.fsdp.rules import FSDPPlan
    from tests.support.model_parallel import compose_config

    cfg = compose_config(
        "strategy=fsdp", *HSDP, f"strategy.replicate={replicate}", "strategy.ep=2", f"world_size={world}"
    )
    dims = FSDPPlan.dims(cfg)
    assert (dims.replicate, dims.shard, dims.ep) == (replicate, world // replicate, 2)
    assert all_groups(dims, ep_group_ranks) == ep_groups
    assert all_groups(dims, replica_ranks) == replicas
    shard_groups = {tuple(dims.group_ranks(r, "shard")) for r in range(world)}
    assert all(any(set(g) <= set(s) for s in shard_groups) for g in ep_groups)
