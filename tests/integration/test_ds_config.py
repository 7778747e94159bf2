"""Bring your own DeepSpeed, for real: each user's file trained by DeepSpeed itself and by the
toolkit in one 1-rank process, step by step; the Hugging Face ZeRO-3 file run through the command
line and as a recipe for every family, judged against the independent reference. Reading the files
(in-process): tests/unit/test_ds_config.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from parallel_lab.cli.run import load_metrics, run_ranks
from tests.support.bodies.ds_config import compare_with_deepspeed
from tests.support.bodies.runs import train_and_record
from tests.support.cli import run_cli, write_config
from tests.support.ds_configs import (
    HF_BATCH,
    HF_LR,
    HF_RUN,
    HF_STEPS,
    HF_ZERO3,
    ISSUE_13_DS_CONFIG,
    assert_resolved,
    ds_file,
)
from tests.support.reference import parity_reference

CASES = {  # each: a file as a DeepSpeed user writes it (1 rank, 16 samples a step)
    "issue-13-file": ISSUE_13_DS_CONFIG,
    "adamw-warmupdecay-zero1": {
        "train_batch_size": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 1},
    },
    "sgd-onecycle-zero2": {
        "train_batch_size": 16,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}},
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, "cycle_momentum": True},
        },
        "zero_optimization": {"stage": 2},
    },
    "adam-l2-cosine-zero0": {
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.05, "adam_w_mode": False}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6}},
        "gradient_clipping": 1.0,
    },
}
STEPS = 4


@pytest.fixture(scope="module")
def deepspeed_and_ours(tmp_path_factory) -> dict[str, dict]:
    """Every CASES file trained both ways (DeepSpeed building the optimizer and schedule from the
    file itself, and the toolkit), in one 1-rank process: its start, DeepSpeed's import and its
    comm op cost more than the cases. Case name -> both runs' losses, learning rates, weights."""
    root = tmp_path_factory.mktemp("ds_files")
    cases = []
    for name, content in CASES.items():
        path = ds_file(root, content, f"{name}.json")
        stage = (content.get("zero_optimization") or {}).get("stage", 0)
        overrides = (f"strategy=zero{stage}", f"strategy.ds_config={path}", "world_size=1", "data.size=64")
        cases.append([path, write_config(root / f"{name}.yaml", *overrides)])
    out = run_ranks(compare_with_deepspeed, 1, timeout=300, cases=cases, steps=STEPS)
    return dict(zip(CASES, json.loads(out[0].strip().splitlines()[-1])))


@pytest.mark.floats  # our losses and weights equal DeepSpeed's own run's
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_files_train_exactly_as_deepspeed_runs_them(deepspeed_and_ours, name):
    """Same losses, learning rates and final weights, bit for bit, as DeepSpeed building the optimizer
    and schedule from the file itself: what the file sets is what the run does."""
    result = deepspeed_and_ours[name]
    theirs, ours = result["theirs"], result["ours"]
    print(name, theirs, ours)
    assert ours["optimizer"] == theirs["optimizer"], name
    assert ours["lr"] == theirs["lr"] and ours["loss"] == theirs["loss"], name
    assert result["same_weights"], name
    if name != "issue-13-file":  # its warm-up spans 1000 steps: the others must really move the LR
        assert len(set(ours["lr"])) > 2, name


# ----- issue 26: the Hugging Face ZeRO-3 file ("auto" filled from the run's config), trained -----
# trainer.recipe=<HF file>, world_size=2: one strategy per family (ZeRO: the --deepspeed_config run itself);
# manual_ddp and zero2 would add ~7 s and share these rows' code paths.
RECIPE_ROWS = ("ddp", "fsdp", "tp", "pp")


def _run_recipe_rows(root: Path, path: str) -> dict[str, dict]:
    """Every RECIPE_ROWS strategy trained on the recipe in ONE set of 2 ranks (tests/support/bodies/runs.py)."""
    configs = {
        s: write_config(root / f"{s}.yaml", f"strategy={s}", f"trainer.recipe={path}", *HF_RUN) for s in RECIPE_ROWS
    }
    run_ranks(train_and_record, world_size=2, timeout=300, config_paths=list(configs.values()))
    return {s: {**load_metrics(root / s), "run_dir": str(root / s), "config": configs[s]} for s in RECIPE_ROWS}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """The HF ZeRO-3 file run for real: through the command line (--deepspeed_config, ZeRO-3 with cpu
    offload of optimizer and parameters, world_size=2), and as trainer.recipe over RECIPE_ROWS."""
    root = tmp_path_factory.mktemp("hf_auto")
    path = ds_file(root, HF_ZERO3, "hf_zero3.json")
    run_dir = root / "zero3_cli"
    run_cli(run_dir, "--deepspeed", f"--deepspeed_config={path}", *HF_RUN, timeout=300)
    zero3 = {**load_metrics(run_dir), "run_dir": str(run_dir), "config": str(run_dir / "config.yaml")}
    return {"zero3": zero3, **_run_recipe_rows(root, path)}


@pytest.fixture(scope="module")
def hf_reference():
    return parity_reference("cnn", steps=HF_STEPS, global_batch=HF_BATCH, lr=HF_LR)


def _print_verdict(label: str, verdict) -> None:
    ratios = ", ".join(f"{name} {check.ratio:.3g}" for name, check in verdict.checks().items())
    print(f"{label}: {ratios}")


@pytest.mark.slow
@pytest.mark.parity
def test_hf_zero3_file_runs_and_matches_the_reference(hf_runs, hf_reference):
    """(a) the run's config.yaml shows every resolved value with its source; (b) it trains as the
    independent reference does (constant-LR Adam, no decay, no clipping), by the parity criterion."""
    metrics = hf_runs["zero3"]
    cfg = OmegaConf.load(metrics["config"])  # the run's own config.yaml, as its workers read it
    assert_resolved(cfg, "strategy.ds_config")
    assert (cfg.strategy.name, cfg.strategy.offload, metrics["world_size"]) == ("zero3", "cpu", 2)
    _print_verdict("zero3 --deepspeed_config", hf_reference.assert_run_matches(metrics, "hf-zero3"))


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("strategy", RECIPE_ROWS)
def test_hf_file_as_a_recipe_matches_the_reference_on_every_row(hf_runs, hf_reference, strategy):
    metrics = hf_runs[strategy]
    cfg = OmegaConf.load(metrics["config"])
    assert_resolved(cfg, "trainer.recipe")
    _print_verdict(f"recipe {strategy}", hf_reference.assert_run_matches(metrics, f"hf-recipe-{strategy}"))


# ----- issue 32: the same file with no LR warm-up on the command line: HF's rule fills it -----
@pytest.mark.slow
def test_hf_zero3_file_with_auto_warmup_trains_with_hfs_schedule(tmp_path):
    """The HF ZeRO-3 file unedited, nothing but the run's own settings on the command line:
    "warmup_num_steps": "auto" is trainer.warmup_steps (HF's get_warmup_steps: its warmup_steps), the
    run trains, and the schedule its workers build is the one DeepSpeed builds from the file as HF's
    Trainer fills it (written out here: min 0, max learning_rate, warmup warmup_steps, total steps)."""
    import math

    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from parallel_lab.optim import make_scheduler, optimizer_factory

    path = ds_file(tmp_path, HF_ZERO3, "hf_zero3.json")
    warmup, steps = 2, 6
    run_dir = tmp_path / "run"
    flags = ["world_size=2", f"trainer.steps={steps}", f"trainer.global_batch={HF_BATCH}", "trainer.eval_batches=0"]
    run_cli(run_dir, "--deepspeed", f"--deepspeed_config={path}", *flags, f"trainer.warmup_steps={warmup}", timeout=300)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    entry = cfg.ds_auto["strategy.ds_config"]["scheduler.params.warmup_num_steps"]
    assert (entry.value, entry["from"]) == (warmup, "trainer.warmup_steps (HF's warmup_steps)")
    metrics = load_metrics(run_dir)
    assert len(metrics["losses"]) == steps and all(math.isfinite(x) for x in metrics["losses"])

    def lrs(optimizer, scheduler) -> list[float]:
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    hf = dict(warmup_min_lr=0, warmup_max_lr=HF_LR, warmup_num_steps=warmup, total_num_steps=steps)
    theirs_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=HF_LR)
    theirs = lrs(theirs_opt, WarmupDecayLR(theirs_opt, **hf))
    ours_opt = optimizer_factory(cfg.trainer)([torch.nn.Parameter(torch.zeros(1))])  # as the workers build it
    ours = lrs(ours_opt, make_scheduler(cfg.trainer, ours_opt))
    assert ours == pytest.approx(theirs, rel=1e-12) and len(set(theirs)) > 2, (ours, theirs)
