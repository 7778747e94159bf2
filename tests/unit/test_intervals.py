"""The report's time intervals (parallel_lab/report/intervals.py, timing.py) on synthetic samples,
the sweep's rotating round order (cli/sweep.py run_rounds) and the faster / same-within-noise
wording (no processes: the real sweep's fields are checked in tests/integration/test_comparison.py)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from parallel_lab.cli.sweep import run_rounds
from parallel_lab.protocol import CONFIG_FILE, RunMetrics
from parallel_lab.report.intervals import SAME, Interval, median_ci, order_ranks, rotation, verdict
from parallel_lab.report.rows import Row
from parallel_lab.report.table import markdown

TRIALS = 4000
LOGNORMAL_MEDIAN = 1.0  # exp(mu) with mu = 0: a skewed distribution, its median known exactly


def coverage(method, n: int, draw, median: float, seed: int = 0) -> float:
    """How often method(samples) holds the true median, over TRIALS samples of n draws."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(TRIALS):
        ci = method([draw(rng) for _ in range(n)])
        hits += ci.low <= median <= ci.high
    return hits / TRIALS


def wrong_one_rank_narrower(samples: list[float]) -> Interval:
    """Planted: the order statistics one rank inside the right ones (a too-narrow interval)."""
    xs, (k, _) = sorted(samples), order_ranks(len(samples))
    return Interval(statistics.median(xs), xs[k], xs[len(xs) - 1 - k], len(xs), 0.95)


def wrong_mean_interval(samples: list[float]) -> Interval:
    """Planted: the normal interval of the mean, taken for the median of a skewed distribution."""
    mean, half = statistics.mean(samples), 1.96 * statistics.stdev(samples) / math.sqrt(len(samples))
    return Interval(mean, mean - half, mean + half, len(samples), 0.95)


DRAWS = {
    "lognormal": (lambda rng: rng.lognormvariate(0.0, 1.0), LOGNORMAL_MEDIAN),
    "exponential": (lambda rng: rng.expovariate(1.0), math.log(2)),  # step times: a floor and a long tail
}


@pytest.mark.parametrize("n", [5, 12, 30])
@pytest.mark.parametrize("dist", list(DRAWS))
def test_the_interval_holds_the_median_at_its_stated_rate(n, dist):
    draw, median = DRAWS[dist]
    level = order_ranks(n)[1]
    rate = coverage(median_ci, n, draw, median)
    # The rate a correct method reaches, within 4 standard errors of TRIALS draws.
    tolerance = 4 * math.sqrt(level * (1 - level) / TRIALS)
    assert rate == pytest.approx(level, abs=tolerance), (n, dist, rate, level)
    assert level >= 0.95 or n < 6  # 95% from 6 samples on; fewer: the range, its level stated
    for planted in (wrong_one_rank_narrower, wrong_mean_interval):  # the same check catches both
        if n >= 12:
            assert coverage(planted, n, draw, median) < level - tolerance, planted.__name__


def test_order_ranks_and_edge_cases():
    assert order_ranks(5) == (1, 1 - 2 / 32)  # the range: 93.75%
    k, level = order_ranks(20)
    assert (k, round(level, 4)) == (6, 0.9586)  # the textbook ranks for n = 20: x(6), x(15)
    assert median_ci([]) is None
    one = median_ci([3.0])
    assert (one.median, one.low, one.high, one.level) == (3.0, 3.0, 3.0, 0.0)
    ci = median_ci([5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0, 8.0], over="steps")
    assert ci.low <= ci.median <= ci.high and ci.over == "steps" and ci.median == 4.5
    rate = ci.map(lambda ms: 64 / ms)  # a decreasing map swaps the ends
    assert rate.low == 64 / ci.high and rate.high == 64 / ci.low


def test_rotating_order():
    items = ["single", "ddp", "fsdp", "zero1"]
    orders = [rotation(items, r) for r in range(len(items))]
    assert orders[0] == items and orders[1] == ["ddp", "fsdp", "zero1", "single"]
    for order in orders:
        assert sorted(order) == sorted(items)  # every strategy once per round
    for position in range(len(items)):  # over n rounds each strategy takes every place once
        assert sorted(o[position] for o in orders) == sorted(items)
    assert rotation(items, 5) == orders[1] and rotation([], 3) == []


def _metrics(strategy: str, step_ms: list[float], **extra) -> RunMetrics:
    """A finished run's record with these per-step times (no warm-up)."""
    fields = dataclasses.fields(RunMetrics)
    required = {f.name: None for f in fields if dataclasses.MISSING is f.default is f.default_factory}
    required.update(
        strategy=strategy, launcher="spawn", world_size=1, model="cnn", global_batch=64, steps=len(step_ms),
        step_times_s=[t / 1000 for t in step_ms], step_time_s=statistics.median(step_ms) / 1000,
        samples_per_s=64000 / statistics.median(step_ms), ranks=[{}], strategy_options={}, step_split_s={},
        comm_bytes_per_step=0.0, comm_volume_psi=0.0, losses=[], threads=1, device="cpu",
        model_flops_per_step=1e9, warmup_steps=0,
    )  # fmt: skip
    return RunMetrics(**{**required, **extra})


def test_run_rounds_runs_every_strategy_once_per_round_in_rotating_order(tmp_path: Path):
    runs = []
    for i, name in enumerate(["single", "ddp", "fsdp"]):
        run_dir = tmp_path / f"{i}_{name}"
        run_dir.mkdir()
        OmegaConf.save(
            OmegaConf.create({"trainer": {"rounds": 3, "checkpoint_every": 5, "checkpoint_dir": None}}),
            run_dir / CONFIG_FILE,
        )
        runs.append(Row(str(run_dir), metrics=_metrics(name, [10.0])))
    started = []
    run_rounds(
        runs, tmp_path, lambda cfg, out: started.append((out.parent.name, out.name, cfg.trainer.checkpoint_every))
    )
    assert started == [
        ("r1", "1_ddp", 0), ("r1", "2_fsdp", 0), ("r1", "0_single", 0),
        ("r2", "2_fsdp", 0), ("r2", "0_single", 0), ("r2", "1_ddp", 0),
    ]  # fmt: skip


SLOW = [30.0 + 0.1 * i for i in range(12)]
FAST = [20.0 + 0.1 * i for i in range(12)]


def test_faster_only_where_the_intervals_separate(tmp_path: Path):
    rows = [
        Row(str(tmp_path / "0_single"), metrics=_metrics("single", SLOW)),
        Row(str(tmp_path / "1_ddp"), metrics=_metrics("ddp", FAST)),  # separated: faster
        Row(str(tmp_path / "2_fsdp"), metrics=_metrics("fsdp", [t + 0.05 for t in SLOW])),  # overlapping
        Row(str(tmp_path / "3_zero1"), metrics=_metrics("zero1", [t + 20 for t in SLOW])),  # separated: slower
        Row(str(tmp_path / "4_zero2"), metrics=_metrics("zero2", [t - 0.05 for t in SLOW])),  # overlapping, below
    ]
    text = markdown(rows)
    header = text.splitlines()[0].strip("| ").split(" | ")
    cells = {
        line.split(" | ")[0][2:]: dict(zip(header, line.strip("| ").split(" | "))) for line in text.splitlines()[2:7]
    }
    assert cells["single"]["vs single"] == "baseline"
    assert cells["ddp"]["vs single"] == f"{statistics.median(SLOW) / statistics.median(FAST):.2f}× faster"
    assert cells["fsdp"]["vs single"] == cells["zero2"]["vs single"] == SAME  # medians above and below
    assert cells["zero1"]["vs single"].endswith("× slower")
    assert cells["ddp"]["step ms"] == "20.55 (20.20–20.90)"  # the median and its order statistics x(3), x(10) (96.1%)
    assert "over 12 steps (holds the median 96.1%)" in text
    # One sample has no interval: no verdict, however far apart the medians.
    assert verdict(median_ci([10.0]), median_ci(SLOW)) == ""


def test_mfu_peak_weights_each_kernels_peak_by_the_models_flops_in_it():
    """MFU's peak for a model's mix of kernels (report/timing.py blended_peak): all-conv runs at the
    conv peak, all-matmul at the matmul peak, a mix at F / sum(F_k / peak_k), never the faster
    kernel alone; the split counts every layer once (worker/metrics.py model_flops_by_kind). The
    GPU's numbers: fp32 conv in TF32 at 276,562 GFLOP/s, matmul far below it."""
    from parallel_lab.config import compose_config
    from parallel_lab.models import build_meta_model
    from parallel_lab.models.flops import layer_flops
    from parallel_lab.report.timing import blended_peak
    from parallel_lab.worker.metrics import FWD_BWD, model_flops_by_kind

    peak = {"conv_gflops": 276_562.0, "matmul_gflops": 50_000.0, "peak_gflops": 276_562.0}
    assert blended_peak(peak, {"conv": 3.0, "matmul": 0.0})["peak_gflops"] == pytest.approx(276_562.0)
    assert blended_peak(peak, {"conv": 0.0, "matmul": 3.0})["peak_gflops"] == pytest.approx(50_000.0)
    half = blended_peak(peak, {"conv": 1.0, "matmul": 1.0})["peak_gflops"]
    assert half == pytest.approx(2 / (1 / 276_562.0 + 1 / 50_000.0))
    assert blended_peak(peak, None) is peak  # a record from before the split: the faster kernel, as before
    for model, most in (("cnn", "conv"), ("vit", "matmul")):
        cfg = compose_config([f"model={model}"]).model
        split = model_flops_by_kind(cfg, 16)
        assert sum(split.values()) == pytest.approx(FWD_BWD * sum(layer_flops(build_meta_model(cfg), 16).values()))
        assert split[most] > 0.5 * sum(split.values()), (model, split)
        assert all(v > 0 for v in split.values()), (model, split)  # the vit's patch embedding is a conv
