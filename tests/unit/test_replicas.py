"""The replica check (parallel_lab/worker/replicas.py, Strategy.replica_parameters) in-process: which
ranks the mesh makes replicas, how their digests are compared, and the parity verdict it fails. On
real ranks (a missed all-reduce after the early window, which the envelope passes):
tests/integration/test_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel_lab.report.parity import Check, Replicas, Verdict
from parallel_lab.strategies.base import Strategy
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.worker.replicas import compare, digest


def _keys(dims: MeshDims, rank: int, model: torch.nn.Module) -> set[str]:
    """The default replica_parameters() keys of ``rank`` on a ``dims`` mesh."""
    fake = SimpleNamespace(layout=dims, env=SimpleNamespace(rank=rank), model=model, replica_dims=Strategy.replica_dims)
    return set(Strategy.replica_parameters(fake))


def _groups(dims: MeshDims) -> list[list[int]]:
    model = torch.nn.Linear(2, 2)
    per_rank = [dict.fromkeys(_keys(dims, r, model), "same") for r in range(dims.world)]
    return compare(per_rank)["replica_groups"]


@pytest.mark.parametrize(
    "dims, groups",
    [
        (MeshDims(replicate=4), [[0, 1, 2, 3]]),  # ddp, manual_ddp, zero0-2: every rank
        (MeshDims(replicate=2, shard=2, named=("replicate", "shard")), [[0, 2], [1, 3]]),  # HSDP
        (MeshDims(replicate=2, tp=2), [[0, 2], [1, 3]]),  # dp x tp: the same tp shard
        (MeshDims(replicate=2, pp=2), [[0, 2], [1, 3]]),  # dp x pp: the same stage
        (MeshDims(shard=4), []),  # flat FSDP: every rank its own shard
        (MeshDims(tp=2, named=("tp",)), []),  # pure tp: no replicas
        (MeshDims(), []),  # world 1
    ],
)
def test_the_mesh_names_the_replica_groups(dims, groups):
    assert _groups(dims) == groups


def test_experts_are_compared_only_between_ranks_holding_the_same_share():
    model = torch.nn.Linear(2, 2)
    model.weight.allreduce = False  # DeepSpeed's mark of an expert parameter
    dims = MeshDims(replicate=4, ep=2)
    per_rank = [dict.fromkeys(_keys(dims, r, model), "x") for r in range(4)]
    record = compare(per_rank)
    assert record["replica_groups"] == [[0, 1, 2, 3], [0, 2], [1, 3]]  # the bias everywhere, experts by share


def test_one_differing_copy_names_its_group_and_the_parameter():
    same, other = digest(torch.zeros(3)), digest(torch.tensor([0.0, 0.0, 1e-45]))  # one subnormal bit
    assert same != other
    record = compare([{"a": same, "b": same}, {"a": same, "b": other}, {"c": same}])
    assert record["replica_digests_agree"] is False
    assert record["replica_groups"] == [[0, 1]]
    assert record["replica_groups_disagree"] == [{"ranks": [0, 1], "params": ["b"], "count": 1}]


def test_nothing_held_twice_is_none_not_agreement():
    assert compare([{"a": "1"}, {"b": "2"}])["replica_digests_agree"] is None
    assert compare([{"a": "1"}, {"a": "1"}])["replica_digests_agree"] is True


def test_the_verdict_fails_a_row_whose_replicas_differ_and_says_which_ranks():
    inside = Check(1.0, 1.0, 0.0)
    bad = Replicas(False, [{"ranks": [0, 1], "params": ["fc1.weight"], "count": 1}])
    verdict = Verdict(inside, inside, inside, inside, replicas=bad)
    assert verdict.criterion_passed and not verdict.passed
    assert "replicas differ: ranks 0, 1" in verdict.reason()
    assert verdict.as_dict()["replicas_agree"] is False
    for agree in (True, None):  # None: nothing to compare, the envelope's checks decide
        assert Verdict(inside, inside, inside, inside, replicas=Replicas(agree, [])).passed
    assert Replicas.of({"losses": []}).agree is None  # a record from before the check


def test_the_reports_evidence_column_names_the_ranks_whose_replicas_differ():
    from parallel_lab.report.table import _evidence

    inside = Check(1.0, 1.0, 0.0)
    bad = Replicas(False, [{"ranks": [0, 1], "params": ["fc1.weight"], "count": 1}])
    row = SimpleNamespace(failure=None, parity_checks=Verdict(inside, inside, inside, inside, replicas=bad).as_dict())
    assert _evidence(row) == "replicas differ: ranks 0, 1"
    row.parity_checks["replicas_agree"] = None  # not checked: the check nearest its bound, as before
    assert _evidence(row).startswith("early Δloss")
