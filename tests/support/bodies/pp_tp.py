"""Distributed test body for dp x pp x tp on the vit (``strategy=pp strategy.tp=T``, run with
parallel_lab.cli.run.run_ranks by tests/integration/test_pp_tp.py): each configuration trains
through the real loop in one set of ranks and is checked against things computed here."""

from __future__ import annotations

import torch.distributed as dist

from parallel_lab.models import build_meta_model
from parallel_lab.report.parity import Replicas
from tests.support.bodies.pp_cp import check_pp_cp
from tests.support.bodies.pp_gpt import check_pp_tied_replicas
from tests.support.matrix import judge_each
from tests.support.model_parallel import DATA_SIZE, reference_accuracy, shared_plans
from tests.support.reference import vit_reference


def check(cfg, strategy, metrics, rank: int, label: str) -> None:
    """Every collective first (losses, full_parameters), then the assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()  # collective: tp shards gathered, stages gathered
    plans = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    # each rank holds its own stage's tp shard: fewer parameters than the whole stage
    local = [p.numel() for p in strategy.model.parameters()]
    assert sum(local) < sum(q.numel() for q in full) / cfg.strategy.stages, (label, sum(local))
    if rank == 0:  # the gathered parameters are the same on every rank: one judge (2 cores, one reference)
        ref = vit_reference(cfg, DATA_SIZE)
        for (name, want), got in zip(ref.params.items(), full, strict=True):
            assert got.shape == want.shape, f"[{label}] {name}: {tuple(got.shape)} vs {tuple(want.shape)}"
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))
        if cfg.strategy.precision != "bf16":  # bf16: the fp32 reference net's argmax is not the bf16 forward's
            acc = reference_accuracy(ref.net, cfg.trainer.global_batch, cfg.trainer.eval_batches)
            assert metrics.eval_accuracy == acc, f"[{label}] eval accuracy {metrics.eval_accuracy} vs reference {acc}"
    row = metrics.ranks[rank]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    assert row["comm_bytes_by_op"] == plans[rank].comm, (label, row["comm_bytes_by_op"], plans[rank].comm)
    first_pipeline = [r for r in range(world) if r % cfg.strategy.tp == 0][: cfg.strategy.stages]
    measured = metrics.strategy_extras["pp_activation_peak_bytes"]
    planned = [plans[r].activation_bytes for r in first_pipeline]
    assert measured == planned, (label, measured, planned)


def pp_tp_body(
    rank: int,
    world_size: int,
    configs: dict[str, list[str]],
    steps: int,
    global_batch: int,
    references: dict[str, str | None] | None = None,
) -> None:
    """Train each configuration in turn and check it (tests/support/matrix.py judge_each); a
    configuration with ``strategy.cp=2`` is judged by pp_cp.py (``references``: its gpt's reference
    model), one with ``model=gpt`` by pp_gpt.py (dp x pp, tied embedding)."""
    base = ["model=vit", "strategy=pp", f"world_size={world_size}", "strategy.tp=2", "trainer.eval_batches=1"]

    def judge(name: str, _, cfg, strategy, metrics) -> None:
        if cfg.strategy.cp > 1:  # pp x cp, in these ranks to spare a start-up
            return check_pp_cp(cfg, strategy, metrics, rank, name, (references or {}).get(name))
        if cfg.model.name == "gpt":  # dp x pp on the tied gpt, in these ranks to spare a start-up
            return check_pp_tied_replicas(cfg, strategy, metrics, rank, name)
        return check(cfg, strategy, metrics, rank, name)

    judge_each(configs, steps, global_batch, base, judge)
