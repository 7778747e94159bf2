"""The replica check (parallel_lab/worker/replicas.py, Strategy.replica_parameters) in-process: which
ranks the mesh makes replicas, how their digests are compared, and the parity verdict it fails. On
real ranks (a missed all-reduce after the early window, which the envelope passes):
tests/integration/test_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel_lab.report.parity import Check, Replicas, Verdict
from parallel_lab.strategies.base import Strategy, split_over_tp
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.worker.replicas import compare, digest


def _keys(dims: MeshDims, rank: int, model: torch.nn.Module, strategy: type = Strategy, **attrs) -> set[str]:
    """The default replica_parameters() keys of ``rank`` on a ``dims`` mesh (attrs: e.g. tp's shard_dims)."""
    fake = SimpleNamespace(
        layout=dims, env=SimpleNamespace(rank=rank), model=model, replica_dims=strategy.replica_dims, **attrs
    )
    return set(Strategy.replica_parameters(fake))


def _groups(dims: MeshDims, strategy: type = Strategy, **attrs) -> list[list[int]]:
    model = torch.nn.Linear(2, 2)
    per_rank = [dict.fromkeys(_keys(dims, r, model, strategy, **attrs), "same") for r in range(dims.world)]
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


def test_the_cp_ranks_of_a_replica_are_replicas_unless_fsdp_shards_over_them():
    from parallel_lab.strategies.fsdp.strategy import FSDPStrategy

    # ddp x cp: DDP averages over the world, every rank holds the same weights
    assert _groups(MeshDims(replicate=2, cp=2)) == [[0, 1, 2, 3]]
    # fsdp x cp (x tp): fully_shard over shard x cp, so a cp rank holds its own shard
    assert _groups(MeshDims(shard=1, cp=2, tp=1, named=("shard", "cp", "tp")), FSDPStrategy) == []
    assert _groups(MeshDims(shard=2, cp=2, named=("shard", "cp")), FSDPStrategy) == []


def test_what_every_tp_rank_holds_whole_is_one_copy_and_its_split_layers_are_not():
    split = {"shard_dims": {"weight": 0}}  # tp's split (Megatron's column weight); the bias held whole
    assert _groups(MeshDims(tp=2, named=("tp",)), **split) == [[0, 1]]  # the bias: both tp ranks
    assert _groups(MeshDims(replicate=2, tp=2), **split) == [[0, 1, 2, 3], [0, 2], [1, 3]]  # + the shard's replicas
    keys = _keys(MeshDims(replicate=2, tp=2), 1, torch.nn.Linear(2, 2), **split)
    assert keys == {"tp=1,weight", "bias"}


def test_a_dtensors_placement_on_tp_says_whether_it_is_split():
    from torch.distributed.tensor import Replicate, Shard

    mesh = SimpleNamespace(mesh_dim_names=("shard", "tp"))  # FSDP2 x TP's 2-D mesh
    norm = SimpleNamespace(device_mesh=mesh, placements=(Shard(0), Replicate()))
    column = SimpleNamespace(device_mesh=mesh, placements=(Shard(0), Shard(0)))
    assert not split_over_tp("norm.weight", norm, None) and split_over_tp("fc1.weight", column, None)
    assert split_over_tp("x", torch.zeros(1), None)  # a strategy naming no split: the tp coordinate stays
    assert not split_over_tp("x", torch.zeros(1), {})


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
    assert _evidence(row).startswith("early Δloss") and "replicas" not in _evidence(row)
    row.parity_checks["replicas_agree"] = True  # compared and equal: the row says so beside its ratio
    assert _evidence(row).endswith("; replicas bit-equal")


def test_the_csv_carries_the_replica_check_of_every_finished_row():
    from parallel_lab.report.columns import READ

    row = SimpleNamespace(ok=True, metrics=SimpleNamespace(replica_digests_agree=False))
    assert READ["replicas agree"](row) is False
    assert READ["replicas agree"](SimpleNamespace(ok=False, metrics=None)) is None


def test_a_tied_pipelines_two_ends_hold_one_key():
    from parallel_lab.worker.replicas import tie_pipeline_ends

    def end(rank: int, dims: MeshDims) -> dict:
        model = torch.nn.Module()
        model.embed = torch.nn.Module()
        model.embed.tokens = torch.nn.Embedding(4, 2)
        model.norm = torch.nn.LayerNorm(2)
        fake = SimpleNamespace(layout=dims, env=SimpleNamespace(rank=rank), model=model, embedding_group=object())
        held = {f"pp={dims.coords(rank)['pp']},{n}": p.detach() for n, p in model.named_parameters()}
        return tie_pipeline_ends(fake, held)

    dims = MeshDims(pp=2, named=("pp",))
    first, last = end(0, dims), end(1, dims)
    assert "tied:embed.tokens.weight" in first and "tied:embed.tokens.weight" in last  # the ends: one key
    assert "pp=0,norm.weight" in first and "pp=1,norm.weight" in last  # the rest: the stage's own
    assert compare([dict.fromkeys(first, "x"), dict.fromkeys(last, "x")])["replica_groups"] == [[0, 1]]
    untied = SimpleNamespace(embedding_group=None)  # not an end of a tied pipeline: keys as they were
    assert list(tie_pipeline_ends(untied, {"pp=1,embed.tokens.weight": torch.zeros(1)})) == ["pp=1,embed.tokens.weight"]
