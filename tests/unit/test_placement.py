"""Inter-host bytes per step (parallel_lab/comm/placement.py): which groups span hosts when ranks sit
on hosts in blocks of nproc_per_node. Pure functions, in-process; tests/integration/test_meshes.py
applies the same function to a real HSDP run's per-rank bytes, tests/integration/test_multinode.py
checks it on two simulated hosts."""

from __future__ import annotations

from parallel_lab.comm.placement import group_ranks, inter_host_bytes_per_step, mesh_group

HSDP = {"replicate": 2, "shard": 2}


def ranks_with(by_group: dict[int, dict[str, float]]) -> list[dict]:
    return [{"rank": rank, "comm_bytes_by_group": groups} for rank, groups in sorted(by_group.items())]


def test_mesh_groups_are_row_major_like_init_device_mesh():
    # rank = r * shard + s: shard groups are runs of consecutive ranks, replicate groups take one of each
    assert [mesh_group(k, HSDP, "shard") for k in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [mesh_group(k, HSDP, "replicate") for k in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    dims = {"replicate": 2, "tp": 3}
    assert mesh_group(4, dims, "tp") == [3, 4, 5] and mesh_group(4, dims, "replicate") == [1, 4]
    assert group_ranks("world", 1, 3, None) == [0, 1, 2] and group_ranks("ranks 2,5", 0, 6, None) == [2, 5]
    assert group_ranks("some backend name", 0, 4, HSDP) is None


def test_hsdp_on_two_hosts_only_the_replicate_dimension_crosses():
    per_rank = {k: {"replicate": 100.0, "shard": 300.0} for k in range(4)}
    ranks = ranks_with(per_rank)
    assert inter_host_bytes_per_step(ranks, nodes=1, nproc_per_node=4, mesh_dims=HSDP) == 0
    assert inter_host_bytes_per_step(ranks, nodes=2, nproc_per_node=2, mesh_dims=HSDP) == 100
    # one rank per host: the shard groups span hosts too
    assert inter_host_bytes_per_step(ranks, nodes=4, nproc_per_node=1, mesh_dims=HSDP) == 400


def test_flat_world_crosses_on_several_hosts_and_the_busiest_rank_counts():
    ranks = ranks_with({0: {"world": 50.0}, 1: {"world": 70.0}})
    assert inter_host_bytes_per_step(ranks, nodes=1, nproc_per_node=2) == 0
    assert inter_host_bytes_per_step(ranks, nodes=2, nproc_per_node=1) == 70


def test_named_subgroups_count_only_when_their_ranks_span_hosts():
    ranks = ranks_with({0: {"ranks 0,1": 10.0, "ranks 0,2": 20.0}, 1: {"ranks 0,1": 10.0}, 2: {}, 3: {}})
    assert inter_host_bytes_per_step(ranks, nodes=2, nproc_per_node=2) == 20  # 0,1 on host 0; 0,2 across
    unknown = ranks_with({0: {"gloo:7": 5.0}, 1: {}})  # cannot tell its ranks: an upper bound
    assert inter_host_bytes_per_step(unknown, nodes=2, nproc_per_node=1) == 5
