"""The comparison's ``comm Ψ meas/theory`` column for the model-parallel rows: tp runs on the vit
(Megatron's split without and with sequence parallelism, and with it under full recompute, whose
recomputed forward repeats the collectives; 2 micro-batches), a pp run (1F1B, 2 stages) and a ddp
run with context parallelism (ring attention, cp=2) on 2 real gloo ranks show a theory
(report/columns.py ``_theory_psi``: the planner's formula for rank 0, Megatron's per block for tp,
stored by rank 0 as metrics.json's ``comm_planned_psi`` and equal to the report's own from config.yaml)
equal to what the run's communication counter measured; an fsdp run's counted bytes are the
planner's for its 2 micro-batches, each gathering and reduce-scattering (its theory 2 x 3Ψ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RUNS = {
    "tp": ["strategy=tp", "strategy.tp=2", "strategy.impl=manual"],
    "tp_sp": ["strategy=tp", "strategy.tp=2", "strategy.impl=manual", "strategy.sequence_parallel=true"],
    # full recompute reruns each block's forward in backward and its collectives, to its last saving
    # op: without dropout not the MLP's g (tp/predict.py block_collectives), with dropout every one
    "tp_full": ["strategy=tp", "strategy.tp=2", "strategy.impl=manual", "trainer.recompute=full"],
    "tp_sp_full_dropout": [
        *("strategy=tp", "strategy.tp=2", "strategy.impl=manual", "strategy.sequence_parallel=true"),
        *("trainer.recompute=full", "model.dropout=0.1"),
    ],
    "pp": ["strategy=pp", "strategy.stages=2", "strategy.schedule=1f1b", "strategy.microbatches=2"],
    # context parallelism: ring attention's K/V hops and the gradients' all-reduce (docs/cp.md)
    "cp": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ring"],
    # FSDP2 gathers and reduce-scatters in every micro-batch (no no_sync): the plan's bytes x 2
    "fsdp": ["strategy=fsdp"],
}


def comm_body(rank: int, world_size: int, out: str) -> None:
    """Train each run for 1 step (grad_accum 2) through the real loop; rank 0 writes its run
    folder as the launcher leaves one (config.yaml, metrics.json)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tests.support.model_parallel import train_configuration

    for name, overrides in RUNS.items():
        run = ["model=vit", f"world_size={world_size}", "trainer.grad_accum=2", "trainer.eval_batches=0", *overrides]
        cfg, strategy, metrics = train_configuration(1, 16, *run)
        if rank == 0:
            folder = Path(out) / name
            folder.mkdir()
            OmegaConf.save(cfg, folder / "config.yaml")
            metrics.write(folder / "metrics.json")
        strategy.teardown()
        dist.barrier()
    print(json.dumps(sorted(RUNS)))


@pytest.mark.slow
def test_tp_sp_and_pp_rows_show_a_theory_equal_to_the_measurement(tmp_path):
    from parallel_lab.cli.run import run_ranks
    from parallel_lab.config import load_run_config
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.report.columns import READ, _planned_psi
    from parallel_lab.report.rows import load_runs
    from parallel_lab.strategies import get_strategy_class

    run_ranks(comm_body, 2, timeout=300, out=str(tmp_path))
    rows = {Path(r.run_dir).name: r for r in load_runs([tmp_path])}
    assert sorted(rows) == sorted(RUNS)
    fsdp = rows.pop("fsdp")  # a ZeRO-paper formula (3Ψ a micro-batch, unpadded): the planner's padded bytes
    cfg = load_run_config(str(Path(fsdp.run_dir) / "config.yaml"))
    plan = plan_world(cfg, get_strategy_class("fsdp"), build_meta_model(cfg.model))
    assert fsdp.metrics.comm_theory_psi == 2 * 3.0, fsdp.metrics.comm_theory_psi
    assert fsdp.metrics.ranks[0]["comm_bytes_by_op"] == plan[0].comm, (fsdp.metrics.ranks[0], plan[0].comm)
    for name, row in rows.items():
        measured, theory = READ["comm Ψ measured"](row), READ["comm Ψ theory"](row)
        assert row.metrics.comm_theory_psi is None  # no ZeRO-paper formula: the column's own
        # rank 0 stored the planner's figure (the report reads it); the report's own from config.yaml agrees
        assert row.metrics.comm_planned_psi == _planned_psi(row.run_dir, row.metrics.params), name
        assert measured > 0 and theory == pytest.approx(measured, rel=1e-12), (name, measured, theory)
