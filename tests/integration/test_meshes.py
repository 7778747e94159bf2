"""2-D device meshes at world size 4: HSDP (strategy=fsdp strategy.sharding=hybrid), dp x tp and
dp x pp (strategy.replicate=2), each judged against the plain-torch single-process reference with
the parity criterion, their communication counted per mesh dimension, and a twin that skips the
gradient average across the replicate dimension caught by the same criterion. Bad degrees, refused
in the parent (in-process): tests/unit/test_meshes.py."""

from __future__ import annotations

import json

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.report.parity import ENVELOPE_MULTIPLE
from tests.support.bodies.mesh import layouts_body
from tests.support.model_parallel import BATCH, DATA_SIZE, STEPS, cnn_reference

WORLD = 4
HYBRID = ["strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2"]
DP_TP = ["strategy=tp", "strategy.tp=2", "strategy.replicate=2"]
DP_PP = ["strategy=pp", "strategy.stages=2", "strategy.replicate=2", "strategy.microbatches=2"]


def _run_layouts(runs: list[tuple[list[str], str]]) -> list[dict]:
    out = run_ranks(
        layouts_body,
        world_size=WORLD,
        timeout=400,
        runs=[[[f"world_size={WORLD}", *overrides], variant] for overrides, variant in runs],
        steps=STEPS,
        global_batch=BATCH,
    )
    return json.loads(out[0])


def _per_dim(result: dict) -> list[dict]:
    """Every rank's bytes per step on each mesh dimension's group."""
    return [r["comm_bytes_by_group"] for r in result["ranks"]]


def _assert_real(result: dict, dims: dict) -> None:
    label = " ".join(result["overrides"])
    assert result["passed"], f"{label}: not the same training as single: {result['reason']}"
    assert result["replicas_agree"] is True, label  # its replicate groups compared, bit for bit equal
    assert result["eval_accuracy"] == result["reference_accuracy"], label
    assert result["mesh"]["dims"] == dims, label
    for rank, (r, groups) in enumerate(zip(result["ranks"], _per_dim(result))):
        # Across replicas: one all-reduce of this rank's gradients (2x their bytes, the counter's
        # unit), the same volume whatever the other dimension does.
        assert groups["replicate"] == 2 * r["param_bytes"], f"{label} rank {rank}: {groups} vs {r}"


def _hsdp(result: dict) -> None:
    psi = 4 * result["params"]
    _assert_real(result, {"replicate": 2, "shard": 2})
    for r, groups in zip(result["ranks"], _per_dim(result)):
        assert r["param_bytes"] == r["analytic_param_bytes"] == psi // 2  # sharded over 2, not 4
        # Inside a shard group: all-gather forward and backward + reduce-scatter = 3Ψ (the cnn's
        # dimensions are even: no padding); across: the Ψ/2 gradient shard all-reduced = Ψ.
        assert groups["shard"] == 3 * psi and groups["replicate"] == psi


def _dp_tp(result: dict) -> None:
    _assert_real(result, {"replicate": 2, "tp": 2})
    assert all(0 < groups["tp"] < groups["replicate"] for groups in _per_dim(result))  # activations only
    # The replica check: a tp shard is compared with its replica's, what every tp rank holds whole
    # (the convolutions, fc2's bias) across all four ranks
    assert result["replica_groups"] == [[0, 1, 2, 3], [0, 2], [1, 3]], result["replica_groups"]


def _dp_pp(result: dict) -> None:
    psi = 4 * result["params"]
    _assert_real(result, {"replicate": 2, "pp": 2})
    stage_bytes = [r["param_bytes"] for r in result["ranks"]]
    assert stage_bytes[:2] == stage_bytes[2:] and sum(stage_bytes[:2]) == psi  # each pipeline: the whole model
    assert all(groups["pp"] > 0 for groups in _per_dim(result))


def _hsdp_without_replica_average(broken: dict) -> None:
    # The broken twin: nothing crosses the replicate dimension, and parity says so.
    assert all(groups.get("replicate", 0) == 0 for groups in _per_dim(broken))
    assert not broken["passed"] and broken["ratios"]["early_dloss"] > ENVELOPE_MULTIPLE, broken
    assert broken["replicas_agree"] is False, broken  # and the verdict read the replica check too


LAYOUTS = {  # id -> (overrides, broken variant or "", what its result must show)
    "hsdp": (HYBRID, "", _hsdp),
    "dp_tp": (DP_TP, "", _dp_tp),
    "dp_pp": (DP_PP, "", _dp_pp),
    "hsdp-without-replica-average": (HYBRID, "HybridWithoutReplicaAverage", _hsdp_without_replica_average),
}


@pytest.fixture(scope="module")
def layouts() -> dict[str, dict]:
    """Every LAYOUTS run, trained in one set of 4 ranks; id -> its result."""
    return dict(zip(LAYOUTS, _run_layouts([(overrides, variant) for overrides, variant, _ in LAYOUTS.values()])))


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_layouts_match_single_and_a_missing_replica_average_fails(layouts, layout):
    """HSDP 2x2, dp2 x tp2, dp2 x pp2 equal single; HSDP without the replicate all-reduce FAILS."""
    LAYOUTS[layout][2](layouts[layout])


EXTRA_LAYOUTS = {  # id -> (overrides, broken variant or ""): more impls and clipping, more broken twins
    "dp_tp-dtensor": (DP_TP + ["strategy.impl=dtensor"], ""),
    "dp_pp-torch-1f1b": (DP_PP + ["strategy.impl=torch", "strategy.schedule=1f1b"], ""),
    "dp_tp-grad_clip": (DP_TP + ["trainer.grad_clip=0.05"], ""),
    "dp_pp-grad_clip": (DP_PP + ["trainer.grad_clip=0.05"], ""),
    "hsdp-grad_clip": (HYBRID + ["trainer.grad_clip=0.05"], ""),
    "dp_tp-without-replica-average": (DP_TP, "TPWithoutReplicaAverage"),
    "dp_pp-without-replica-average": (DP_PP, "PPWithoutReplicaAverage"),
}


@pytest.fixture(scope="module")
def extra_layouts() -> dict[str, dict]:
    """Every EXTRA_LAYOUTS run, trained in one set of 4 ranks; id -> its result."""
    return dict(zip(EXTRA_LAYOUTS, _run_layouts(list(EXTRA_LAYOUTS.values()))))


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.extra  # the layouts' claims are proven by the make-test case above; these add impls and clipping
@pytest.mark.parametrize("layout", list(EXTRA_LAYOUTS))
def test_mesh_layouts_other_impls_clipping_and_broken_twins(extra_layouts, layout):
    result = extra_layouts[layout]
    label = f"{' '.join(result['overrides'])} {result['variant']}"
    assert result["passed"] == (not result["variant"]), f"{label}: {result['reason'] or result['ratios']}"


@pytest.mark.floats  # a parity verdict
@pytest.mark.slow
def test_hybrid_command_end_to_end_with_its_report_row(cli, tmp_path):
    """python -m parallel_lab strategy=fsdp strategy.sharding=hybrid strategy.replicate=2 world_size=4:
    the same training as single, and the report's row shows the mesh and the bytes per dimension."""
    from parallel_lab.comm.placement import inter_host_bytes_per_step
    from parallel_lab.report.table import add_parity, load_runs, markdown

    m = cli(
        *HYBRID,
        f"world_size={WORLD}",
        f"trainer.steps={STEPS}",
        f"trainer.global_batch={BATCH}",
        f"data.size={DATA_SIZE}",
    )
    cnn_reference().assert_run_matches(m)
    mesh = m["strategy_extras"]["mesh"]
    psi = 4 * m["params"]
    assert mesh == {"dims": {"replicate": 2, "shard": 2}, "comm_bytes_per_step": {"replicate": psi, "shard": 3 * psi}}
    assert m["comm_theory_psi"] == 4.0 and m["comm_volume_psi"] == 4.0  # 3Ψ inside + 2Ψ/2 across
    # One host: nothing crosses. The same ranks laid out 2 hosts x 2 (comm/placement.py): only the
    # replicate dimension crosses; 4 hosts x 1: everything does.
    assert (m["nodes"], m["nproc_per_node"], m["inter_host_bytes_per_step"]) == (1, WORLD, 0.0)
    assert inter_host_bytes_per_step(m["ranks"], 2, 2, mesh["dims"]) == psi
    assert inter_host_bytes_per_step(m["ranks"], 4, 1, mesh["dims"]) == 4 * psi
    runs = load_runs([tmp_path])
    add_parity(runs)  # what write_report renders into comparison.md, without its plots
    text = markdown(runs)
    row = next(line for line in text.splitlines() if line.startswith("| fsdp"))
    mib = psi / 2**20
    assert f"| replicate 2 ({mib:#.4g}) × shard 2 ({3 * mib:#.4g}) |" in row, row  # the md's 4 digits
