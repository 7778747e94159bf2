"""The Strategy interface stays small and split by concern (in-process): the runtime class has at
most 15 methods, and planning, model state, memory accounting and BatchNorm each live in a part of
their own, for every registered strategy. The composable mesh's layout (``MeshDims``) against an
independent row-major layout of the ranks, as ``init_device_mesh`` builds it, for dp x tp x pp."""

from __future__ import annotations

import inspect

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.errors import ConfigError

MAX_RUNTIME_METHODS = 15
# Each concern's part: (Strategy attribute, its base class's module, names that must not be on the
# runtime class of any strategy, because they belong to that part).
CONCERNS = {
    "plan": (
        "parallel_lab.strategies.planning",
        {
            "predict_memory",
            "predict_comm",
            "predict_buffer_bytes",
            "compute_shape",
            "activation_bytes",
            "overlapped_collectives",
            "comm_impl",
            "min_global_batch",
            "check_options",
            "data_parallel_size",
            "comm_theory_psi",
            "degree_key",
            "ranks_differ",
            "allreduce_variants",
        },
    ),
    "State": (
        "parallel_lab.strategies.state",
        {
            "save_checkpoint",
            "load_checkpoint",
            "load_full_state",
            "load_resharded_natively",
            "full_parameters",
            "reshard_refusal",
        },
    ),
    "Memory": (
        "parallel_lab.strategies.memory",
        {"memory_after_backward", "memory_after_step", "memory_buffers", "analytic_memory"},
    ),
    "Norm": (
        "parallel_lab.strategies.batchnorm",
        {"running_stats_group", "convert_batchnorm", "sync_running_stats", "norm_refusal", "syncs_batchnorm"},
    ),
}


def runtime_methods(cls: type) -> list[str]:
    """Every ``def`` in the class body: functions, properties, class and static methods."""
    kinds = (property, classmethod, staticmethod)
    return [name for name, value in vars(cls).items() if inspect.isfunction(value) or isinstance(value, kinds)]


def test_the_runtime_interface_has_at_most_15_methods():
    from parallel_lab.strategies.base import Strategy

    methods = runtime_methods(Strategy)
    assert len(methods) <= MAX_RUNTIME_METHODS, f"Strategy has {len(methods)} methods: {methods}"
    assert {"setup", "train_step", "optimizer_step", "evaluate", "teardown"} <= set(methods)


@pytest.mark.parametrize("name", ["ddp", "dp", "fsdp", "manual_ddp", "pp", "single", "tp", "zero2"])
def test_each_concern_lives_in_its_own_part(name):
    from parallel_lab.strategies import get_strategy_class

    cls = get_strategy_class(name)
    for attr, (module, moved) in CONCERNS.items():
        part = getattr(cls, attr)
        bases = [c.__module__ for c in part.__mro__]
        assert module in bases, f"{name}.{attr} = {part} does not extend the part in {module}"
        on_runtime = sorted(moved & {n for c in cls.__mro__ for n in vars(c)})
        assert not on_runtime, f"strategy={name} keeps {on_runtime} on its runtime class, not in {attr}"


def test_a_registered_strategy_instance_builds_its_parts():
    """single, in-process: the parts are bound to the strategy and read its model."""
    from parallel_lab.comm.dist_env import read_dist_env
    from parallel_lab.strategies import get_strategy_class
    from parallel_lab.strategies.memory import Memory
    from parallel_lab.strategies.state import State
    from tests.support.model_parallel import compose_config

    cfg = compose_config("strategy=single")
    strategy = get_strategy_class("single")(cfg, read_dist_env("cpu"))
    strategy.setup(torch.nn.Linear(3, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    assert isinstance(strategy.state, State) and isinstance(strategy.memory, Memory)
    assert strategy.memory.after_backward()["param_bytes"] == 4 * (3 * 2 + 2)
    assert [p.shape for p in strategy.state.full_parameters()] == [(2, 3), (2,)]


# ----- the composable mesh: dp x tp x pp is one more MeshDims -----
def _row_major_groups(sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """Independent reference: init_device_mesh lays ranks out as arange(world).view(sizes), and a
    dimension's groups are the runs along that axis with every other coordinate fixed."""
    mesh = torch.arange(int(torch.tensor(list(sizes.values())).prod())).view(*sizes.values())
    groups = {}
    for axis, name in enumerate(sizes):
        runs = mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis])
        groups[name] = sorted(run.tolist() for run in runs)
    return groups


def test_three_dimensional_dims_lay_out_ranks_row_major():
    from parallel_lab.comm.placement import mesh_group
    from parallel_lab.strategies.mesh import MeshDims

    dims = MeshDims(pp=2, replicate=2, tp=2)
    sizes = dims.sizes()
    assert sizes == {"replicate": 2, "pp": 2, "tp": 2} and dims.world == 8
    assert dims.data_parallel_size == 2 and dims.metrics() == sizes
    reference = _row_major_groups(sizes)
    for name, groups in reference.items():
        for group in groups:
            for rank in group:
                assert dims.group_ranks(rank, name) == group, (name, rank)
                assert mesh_group(rank, sizes, name) == group  # what metrics.json's placement reads
    mesh = torch.arange(8).view(2, 2, 2)
    for rank in range(8):
        c = dims.coords(rank)
        assert mesh[c["replicate"], c["pp"], c["tp"]] == rank
        assert dims.dp_rank(rank) == c["replicate"]  # the two pipelines x tp groups read two shares
    # a dimension not split: every rank alone along it
    assert dims.group_ranks(5, "shard") == [5] and dims.coords(5)["shard"] == 0


def test_three_dimensional_degrees_are_checked_in_one_line():
    from parallel_lab.strategies.mesh import MeshDims, check_degrees

    dims = MeshDims(pp=2, replicate=2, tp=2)
    keys = {"pp": ("stages", "pipeline stages"), "tp": ("tp", "tensor-parallel degree")}
    check_degrees(OmegaConf.create({"world_size": 8}), dims, keys)
    with pytest.raises(ConfigError) as caught:
        check_degrees(OmegaConf.create({"world_size": 12}), dims, keys)
    message = str(caught.value)
    assert "\n" not in message
    assert "strategy.replicate=2 x strategy.stages=2 x strategy.tp=2 = 8 is not world_size=12" in message
    assert "(data-parallel replicas x pipeline stages x tensor-parallel degree = world_size)" in message
    assert message.endswith("set world_size=8 or strategy.replicate=3")
