"""trainer.profile: the traces exist and say what they claim (docs/profiling.md).

Real runs, real profiler: ddp's bucketed all-reduce overlaps backward (exposed < total comm);
manual_ddp's one all-reduce after backward does not (exposed >= 90% of it); pp's first stage idles
for the GPipe bubble (p-1)/(m+p-1) (arXiv 1811.06965) at two micro-batch counts; the parts of every
traced step add up to the loop's own step time; a run without profiling writes no trace and
records no breakdown. The profiler's cost is printed, never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics
from parallel_lab.report.table import load_runs
from parallel_lab.report.write import write_report
from parallel_lab.worker.timeline import KEYS, PARTS
from tests.support.cli import run_cli

TINY = ("world_size=2", "model=cnn", "trainer.global_batch=32", "trainer.eval_batches=0")
PROFILED = ("trainer.steps=4", "trainer.warmup_steps=2", "trainer.profile=true", "trainer.profile_steps=2")
# Small buckets: several all-reduces per step, the first ones launched while backward still runs.
DDP = ("strategy=ddp", "strategy.bucket_cap_mb=0.2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(name, *overrides): one run per name for the whole module, its metrics (plus run_dir)."""
    done: dict[str, dict] = {}

    def run(name: str, *overrides: str) -> dict:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name)
            run_cli(run_dir, *TINY, *overrides, timeout=180)
            done[name] = {**load_metrics(run_dir), "run_dir": str(run_dir)}
        return done[name]

    return run


def check_parts_add_up(metrics: dict) -> None:
    """Every traced step: the parts partition the trace's step, which is the loop's own step time
    (perf_counter around the same code) within 10%."""
    for rank in metrics["ranks"]:
        assert set(rank["time_ms"]) == set(KEYS)
        assert len(rank["time_ms_steps"]) == len(rank["loop_step_ms"]) == 2
        for step, loop in zip(rank["time_ms_steps"], rank["loop_step_ms"]):
            assert all(step[k] >= 0 for k in KEYS), step
            assert sum(step[k] for k in PARTS) == pytest.approx(step["step"], rel=1e-6)
            assert step["exposed_comm"] <= step["comm"] + 1e-6
            assert step["step"] == pytest.approx(loop, rel=0.10), (rank["rank"], step, loop)


def test_ddp_hides_part_of_its_communication(runs):
    metrics = runs("ddp", *DDP, *PROFILED)
    check_parts_add_up(metrics)
    for rank in metrics["ranks"]:
        t = rank["time_ms"]
        print(f"ddp rank {rank['rank']}: {t} overlap {rank['comm_overlap']:.0%}")
        assert t["comm"] > 0 and t["exposed_comm"] < t["comm"], t
    traces = sorted(p.name for p in (Path(metrics["run_dir"]) / "traces").iterdir())
    assert traces == ["rank0.json", "rank1.json"]
    assert '"comm:all_reduce:' in (Path(metrics["run_dir"]) / "traces" / "rank0.json").read_text()


def test_all_reduce_after_backward_is_exposed(runs):
    metrics = runs("manual_ddp_after_backward", "strategy=manual_ddp", "strategy.bucketed=false", *PROFILED)
    check_parts_add_up(metrics)
    for rank in metrics["ranks"]:
        t = rank["time_ms"]
        print(f"manual_ddp bucketed=false rank {rank['rank']}: {t}")
        assert t["comm"] > 0 and t["exposed_comm"] >= 0.9 * t["comm"], t


# extra: on two cores shared with other jobs a descheduled stage moves the other's idle share by
# more than 0.1 (seen: 0.227 for 0.333); on a quiet machine it lands within 0.03-0.06.
@pytest.mark.extra
@pytest.mark.parametrize("microbatches", [2, 4])
def test_pipeline_idles_for_the_gpipe_bubble(runs, microbatches):
    """The first stage starts a GPipe step first and finishes it last, so its step is the
    pipeline's and its idle share is the bubble (p-1)/(m+p-1). The stages must be about equal for
    the formula to hold: resnet18 cut before layer2 splits its FLOPs 0.59/0.41 (the cnn's best
    cut is 0.68/0.32)."""
    metrics = runs(
        f"pp_m{microbatches}",
        "strategy=pp",
        "model=resnet18",
        "model.width=0.25",
        "strategy.cuts=[layer2]",
        f"strategy.microbatches={microbatches}",
        *PROFILED,
    )
    check_parts_add_up(metrics)
    p, m = 2, microbatches
    first = metrics["ranks"][0]["time_ms"]
    measured, theory = first["idle"] / first["step"], (p - 1) / (m + p - 1)
    print(f"pp m={m}: first stage idle {measured:.3f} of its step, GPipe bubble {theory:.3f}")
    assert measured == pytest.approx(theory, abs=0.1)


def test_no_profile_no_trace_and_the_cost(runs):
    plain = runs("ddp_plain", *DDP, "trainer.steps=4", "trainer.warmup_steps=2")
    assert not (Path(plain["run_dir"]) / "traces").exists()
    assert plain["profile"] == {}
    assert not any(key.startswith(("time_ms", "comm_overlap")) for r in plain["ranks"] for key in r)
    profiled = runs("ddp", *DDP, *PROFILED)
    ratio = profiled["profile"]["profiled_step_s"] / plain["step_time_s"]
    print(f"profiling cost: traced step / unprofiled step = {ratio:.2f} (ddp x2, cnn; timing, not asserted)")


def test_report_draws_the_timeline(runs, tmp_path):
    dirs = [runs("ddp", *DDP, *PROFILED)["run_dir"], runs("manual_ddp_after_backward")["run_dir"]]
    text = write_report(load_runs([Path(d) for d in dirs]), tmp_path)
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert "exposed / comm ms (overlap)" in text
    assert "exposed comm ms (trace)" in (tmp_path / "comparison.csv").read_text()
