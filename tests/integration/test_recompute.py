"""trainer.recompute on real ranks: every strategy trains the vit with recompute=selective and full
exactly as with none, bit for bit (losses and final weights), dropout on, each compared with the
same strategy's own recompute=none run; and the parent refuses it for a model without blocks.
In-process (world 1, the planner's bytes per mode, the dropout masks on recompute): tests/unit/test_vit.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics, run_ranks
from tests.support.bodies.runs import train_and_record
from tests.support.checks import assert_plan_matches
from tests.support.cli import assert_one_clean_line, run_cli, write_config

STEPS, BATCH = 3, 16
RUN = ("model=vit", "model.dropout=0.1", "world_size=2", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}")
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))}
MODES = ("none", "selective", "full")
# make test: the data-parallel, sharded, DeepSpeed (its own checkpoint function), pipeline and
# tensor-parallel (sequence-parallel: its collectives rerun in the recomputation) families, one
# strategy each; the rest under extra.
CASES = {
    "ddp": ("none", "selective"),
    "fsdp": ("none", "full"),
    "zero2": ("none", "full"),
    "pp": ("none", "full"),
    "tp": ("none", "selective"),
}
SP = {"tp": "strategy.sequence_parallel=true"}
EXTRA = {
    "single": MODES,
    "dp": MODES,
    "manual_ddp": MODES,
    "ddp": MODES,
    "fsdp": MODES,
    "zero0": MODES,
    "zero1": MODES,
    "zero2": MODES,
    "zero3": MODES,
    "pp": MODES,
    "tp": MODES,
}


# bf16 (extra): the module cast (fsdp, zero3) recomputes in bf16 too; ddp's per-forward weight
# copies only selectively (full is refused, below).
BF16 = {"fsdp": "strategy.mixed_precision=bf16", "zero3": "strategy.precision=bf16", "ddp": "strategy.precision=bf16"}
EXTRA_BF16 = {"fsdp": MODES, "zero3": MODES, "ddp": ("none", "selective")}


def _train(
    root: Path, cases: dict[str, tuple[str, ...]], extra: dict[str, str] | None = None
) -> dict[tuple[str, str], dict]:
    """(strategy, mode) -> metrics of every case, all trained in turn on ONE set of 2 real gloo ranks
    (extra: more overrides, by strategy)."""
    names = [(s, m) for s, modes in cases.items() for m in modes]
    paths = [
        write_config(
            root / f"{s}-{m}.yaml",
            f"strategy={s}",
            *RUN,
            f"trainer.recompute={m}",
            "trainer.eval_batches=0",
            *([extra[s]] if extra and s in extra else []),
        )
        for s, m in names
    ]
    run_ranks(train_and_record, world_size=2, timeout=600, env=ENV, config_paths=paths)
    return {(s, m): {**load_metrics(root / f"{s}-{m}"), "run_dir": str(root / f"{s}-{m}")} for s, m in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("recompute"), CASES, SP)


def assert_same_training(runs: dict, strategy: str, mode: str) -> None:
    base, ours = runs[(strategy, "none")], runs[(strategy, mode)]
    assert ours["recompute"] == mode and base["recompute"] == "none"  # metrics.json tells the rows apart
    assert ours["losses"] == base["losses"], (strategy, mode, ours["losses"], base["losses"])
    assert_plan_matches(ours, tolerance=0.0)  # recompute changes no model state
    assert ours["final_param_sha256"] == base["final_param_sha256"], (strategy, mode)


@pytest.mark.slow
@pytest.mark.floats
@pytest.mark.parametrize("strategy, mode", [(s, m) for s, modes in CASES.items() for m in modes if m != "none"])
def test_recompute_trains_bit_for_bit_as_none(runs, strategy, mode):
    """Dropout on: the recomputed forward draws the forward's masks (keyed, or the restored RNG on pp's stage 1)."""
    assert_same_training(runs, strategy, mode)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.floats
def test_every_strategy_and_mode_trains_bit_for_bit_as_none(tmp_path):
    """Every strategy x mode; make test keeps the claim alive with test_recompute_trains_bit_for_bit_as_none."""
    runs = _train(tmp_path, EXTRA)
    for strategy, modes in EXTRA.items():
        for mode in modes[1:]:
            assert_same_training(runs, strategy, mode)
    (tmp_path / "bf16").mkdir()
    bf16 = _train(tmp_path / "bf16", EXTRA_BF16, BF16)
    for strategy, modes in EXTRA_BF16.items():
        for mode in modes[1:]:
            assert_same_training(bf16, strategy, mode)


REFUSED = {
    "cnn": (("model=cnn", "trainer.recompute=full"), ("trainer.recompute=full", "model=cnn has none")),
    "resnet18": (("model=resnet18", "trainer.recompute=selective"), ("trainer.recompute=selective", "resnet18 has")),
    "full-on-bf16-weight-copies": (
        ("model=vit", "strategy=ddp", "strategy.precision=bf16", "trainer.recompute=full"),
        ("trainer.recompute=full", "strategy=ddp's per-forward bf16 weight copies"),
    ),
    "unknown-mode": (("model=vit", "trainer.recompute=partial"), ("recompute=partial", "none, selective or full")),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_recompute_is_refused_in_the_parent(tmp_path, case):
    overrides, named = REFUSED[case]
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *overrides, check=False, timeout=120)
    assert_one_clean_line(result, run_dir, named)
    assert result.returncode == 2 and not run_dir.exists()
