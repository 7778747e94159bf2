"""trainer.profile: the traces exist and say what they claim (docs/profiling.md).

Real runs, real profiler: ddp's bucketed all-reduce overlaps backward (exposed < total comm);
manual_ddp's one all-reduce after backward does not (exposed >= 90% of it); pp's first stage idles
for the GPipe bubble (arXiv 1811.06965) predicted from the stages' measured work, at two micro-batch
counts ((p-1)/(m+p-1) when the stages are equal); the parts of every
traced step add up to the loop's own step time; a run without profiling writes no trace and
records no breakdown. The profiler's cost is printed, never asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics
from parallel_lab.report.table import load_runs
from parallel_lab.report.write import write_report
from parallel_lab.strategies.pp.schedules import gpipe_first_stage_idle
from parallel_lab.worker.timeline import KEYS, PARTS, intersect, length, load_events, step_windows, union
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
            keys = {o.split("=")[0] for o in overrides}  # an override replaces TINY's value of its key
            run_cli(run_dir, *(a for a in TINY if a.split("=")[0] not in keys), *overrides, timeout=180)
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


BACKWARD_OP = "autograd::engine::evaluate_function"  # torch.profiler's name for every backward node


def backward_ms(run_dir: str, rank: int) -> float:
    """One stage's backward time per traced step: the union of its autograd nodes' spans inside
    the steps, averaged over them."""
    events = load_events(Path(run_dir) / "traces" / f"rank{rank}.json")
    nodes = union((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(BACKWARD_OP))
    windows = [window for _, window in step_windows(events)]
    return sum(length(intersect(nodes, [w])) for w in windows) / len(windows) / 1000


@pytest.mark.parametrize(
    "microbatches,impl",
    [(2, "manual"), (3, "manual"), pytest.param(2, "torch", marks=pytest.mark.extra)],
    ids=["2", "3", "2-torch"],
)
def test_pipeline_idles_as_gpipe_predicts(runs, microbatches, impl):
    """The first stage starts a GPipe step first and finishes it last, so its idle time is the
    bubble. (p-1)/(m+p-1) (arXiv 1811.06965) holds for equal stages only, and no cut makes these
    equal (resnet18 cut before layer2: FLOPs 0.59/0.41), while load on shared cores skews them
    further. So the bubble is predicted from what each stage measurably did in this very run: its
    forward and backward time (its step minus idle and optimizer, the backward read from its
    autograd nodes; a descheduled stage's lost time counts as its work), played through the GPipe
    schedule (strategies/pp/schedules.py: gpipe_first_stage_idle, (p-1)/(m+p-1) for equal stages,
    unit-tested against a simulation); the first stage's measured idle share must not exceed it by
    more than 0.15 (nor fall 0.2 below it: see the assertion). m = 2 and 3: every further
    micro-batch adds one more hand-off and, under load, one more max
    of two jittery stage times to the real pipeline that mean times do not see (measured: up to
    +0.14 at m = 4, failing 2 of 4 runs under load). The manual loop posts a step's receives at
    its start (gloo moves a tensor only once its receive is posted), so a hand-off already sent no
    longer waits on the critical path (docs/pp.md)."""
    metrics = runs(
        f"pp_m{microbatches}_{impl}",
        "strategy=pp",
        f"strategy.impl={impl}",
        "model=resnet18",
        "model.width=0.25",
        "strategy.cuts=[layer2]",
        "trainer.global_batch=48",  # 24 or 16 samples per micro-batch
        f"strategy.microbatches={microbatches}",
        *PROFILED,
    )
    check_parts_add_up(metrics)
    p, m = 2, microbatches
    times = [rank["time_ms"] for rank in metrics["ranks"]]
    backward = [backward_ms(metrics["run_dir"], rank) for rank in range(p)]
    forward = [t["step"] - t["idle"] - t["optimizer"] - b for t, b in zip(times, backward)]
    first = times[0]
    measured = first["idle"] / first["step"]
    predicted = gpipe_first_stage_idle(forward, backward, m) / first["step"]
    print(
        f"pp {impl} m={m}: forward {forward[0]:.1f}/{forward[1]:.1f} ms, "
        f"backward {backward[0]:.1f}/{backward[1]:.1f} ms; "
        f"first stage idle {measured:.3f} of its step, GPipe predicts {predicted:.3f} "
        f"(equal stages (p-1)/(m+p-1) {(p - 1) / (m + p - 1):.3f})"
    )
    # Alone the three ids come within 0.021 of the prediction (12 runs); beside the other test
    # process (make test runs two) a descheduled stage's lost time counts as its work or as its
    # idle, whichever it was in: 0.226 / 0.328, 0.229 / 0.345 and 0.315 / 0.211 (m = 3) in three
    # suites. A pipeline that waits more than GPipe's order (the fault this catches: 30 ms more a
    # receive) idles 0.3-0.4 above it.
    assert predicted - 0.2 <= measured <= predicted + 0.15, (measured, predicted)


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
    # The profiled parts as medians with intervals over the traced steps (one round): with 2 steps,
    # the range of the ranks' mean of each step, computed here from metrics.json's per-step parts.
    rows = {r["run_dir"]: r for r in json.loads((tmp_path / "comparison.json").read_text())}
    profiled = [d for d in dirs if "time_ms_steps" in load_metrics(Path(d))["ranks"][0]]  # -k alone: ddp only
    assert dirs[0] in profiled
    for run_dir in profiled:
        ranks = load_metrics(Path(run_dir))["ranks"]
        for key in ("compute", "comm", "exposed_comm"):
            per_step = [sum(r["time_ms_steps"][i][key] for r in ranks) / len(ranks) for i in range(2)]
            assert rows[run_dir][f"{key}_ms_ci95"] == pytest.approx([min(per_step), max(per_step)]), key
    ddp_row = next(line for line in text.splitlines() if line.startswith("| ddp"))
    assert ddp_row.split(" | ")[-3].count("–") == 2, ddp_row  # exposed (low–high) / comm (low–high)
