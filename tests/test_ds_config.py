"""Bring your own DeepSpeed: a ds_config.json taken as DeepSpeed takes it, and DeepSpeed's flags.

In-process (the parent's composition and validation) except one 1-rank process that runs each file
through DeepSpeed itself and through the toolkit, and compares them step by step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from parallel_lab.cli.ds_args import _parser, overrides_from_deepspeed_args
from parallel_lab.config import compose_config, validate
from parallel_lab.strategies.zero.ds_config import build_ds_config
from parallel_lab.testing import run_ranks
from tests.conftest import write_config
from tests.test_failures import ISSUE_13_DS_CONFIG


def _file(tmp_path: Path, content: dict, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return str(path)


def _validated(tmp_path: Path, *overrides: str):
    return validate(compose_config(list(overrides)), tmp_path / "run", explicit=list(overrides))


def test_the_issues_file_is_taken_unedited(tmp_path):
    """DeepSpeed's CIFAR example file: every setting it makes is the run's, shown in config.yaml."""
    ds = ISSUE_13_DS_CONFIG
    path = _file(tmp_path, ds)
    cfg = _validated(tmp_path, "strategy=zero0", f"strategy.ds_config={path}", "world_size=2")
    t, opt = cfg.trainer, ds["optimizer"]["params"]
    # DeepSpeed: accumulation 1 when the file gives only the batch
    assert t.global_batch == ds["train_batch_size"] and t.grad_accum == 1
    assert t.grad_clip == ds["gradient_clipping"]
    assert t.optimizer == "adamw"  # DeepSpeed's "Adam" runs in AdamW mode unless adam_w_mode=false
    assert (t.lr, list(t.betas), t.eps, t.weight_decay) == (opt["lr"], opt["betas"], opt["eps"], opt["weight_decay"])
    assert t.lr_scheduler == ds["scheduler"]["type"] and dict(t.lr_scheduler_params) == ds["scheduler"]["params"]
    assert cfg.strategy.precision == "bf16" and cfg.strategy.offload == "none"
    run = build_ds_config(cfg, cfg.strategy)  # what the worker hands DeepSpeed
    assert "optimizer" not in run and "scheduler" not in run  # replaced by the same torch optimizer + schedule
    assert {k: run["zero_optimization"][k] for k in ds["zero_optimization"]} == ds["zero_optimization"]
    assert run["train_batch_size"] == ds["train_batch_size"] and run["gradient_clipping"] == ds["gradient_clipping"]
    assert run["train_micro_batch_size_per_gpu"] == ds["train_batch_size"] // 2 and run["bf16"] == {"enabled": True}


def test_batch_keys_resolve_as_deepspeed_does(tmp_path):
    micro, accum, world = 4, 3, 2
    path = _file(tmp_path, {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum})
    cfg = _validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", f"world_size={world}")
    assert (cfg.trainer.global_batch, cfg.trainer.grad_accum) == (micro * accum * world, accum)
    assert build_ds_config(cfg, cfg.strategy)["train_micro_batch_size_per_gpu"] == micro
    # The file is silent on clipping: DeepSpeed's default applies, unless the command line sets it.
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert cfg.trainer.grad_clip == GRADIENT_CLIPPING_DEFAULT
    explicit = _validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", "trainer.grad_clip=0")
    assert explicit.trainer.grad_clip == 0


def test_command_line_agreeing_with_the_file_and_legacy_offload(tmp_path):
    """An explicit value equal to the file's is no conflict; legacy cpu_offload=true means offload."""
    content = {"train_batch_size": 32, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    path = _file(tmp_path, content)
    cfg = _validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", "trainer.global_batch=32")
    assert cfg.strategy.offload == "cpu" and cfg.trainer.grad_clip == 0.5
    zero = build_ds_config(cfg, cfg.strategy)["zero_optimization"]
    assert zero["cpu_offload"] is True and "offload_optimizer" not in zero  # one of the two spellings, never both


def test_deepspeed_flags_are_deepspeeds(tmp_path):
    """Our --deepspeed/--deepspeed_config/--deepscale* are deepspeed.add_config_arguments' flags."""
    import deepspeed

    def flags(parser: argparse.ArgumentParser) -> dict:
        return {
            a.option_strings[0]: (a.dest, a.default, a.type, a.nargs, a.const)
            for a in parser._actions
            if a.option_strings and a.option_strings[0].startswith("--deep")
        }

    theirs = flags(deepspeed.add_config_arguments(argparse.ArgumentParser()))
    assert theirs and flags(_parser()) == theirs
    path = _file(tmp_path, {"zero_optimization": {"stage": 3}})
    assert overrides_from_deepspeed_args(["--deepspeed", "--deepspeed_config", path, "trainer.steps=2"]) == [
        "strategy=zero3",
        f"strategy.ds_config={path}",
        "trainer.steps=2",
    ]
    assert overrides_from_deepspeed_args(["--local_rank=1", "strategy=zero1"]) == ["strategy=zero1"]


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


@pytest.mark.slow
def test_files_train_exactly_as_deepspeed_runs_them(tmp_path):
    """Same losses, learning rates and final weights, bit for bit, as DeepSpeed building the optimizer
    and schedule from the file itself: what the file sets is what the run does. One process for all
    four files: its start, DeepSpeed's import and its comm op cost more than the cases."""
    cases, names = [], list(CASES)
    for name in names:
        content = CASES[name]
        path = _file(tmp_path, content, f"{name}.json")
        stage = (content.get("zero_optimization") or {}).get("stage", 0)
        overrides = (f"strategy=zero{stage}", f"strategy.ds_config={path}", "world_size=1", "data.size=64")
        cases.append([path, write_config(tmp_path / f"{name}.yaml", *overrides)])
    out = run_ranks("tests.dist_bodies_ds_config:compare_with_deepspeed", 1, timeout=300, cases=cases, steps=STEPS)
    results = json.loads(out[0].strip().splitlines()[-1])
    for name, result in zip(names, results):
        theirs, ours = result["theirs"], result["ours"]
        print(name, theirs, ours)
        assert ours["optimizer"] == theirs["optimizer"], name
        assert ours["lr"] == theirs["lr"] and ours["loss"] == theirs["loss"], name
        assert result["same_weights"], name
        if name != "issue-13-file":  # its warm-up spans 1000 steps: the others must really move the LR
            assert len(set(ours["lr"])) > 2, name


def test_recipe_gives_every_strategy_the_files_training(tmp_path):
    """trainer.recipe: the same optimizer, schedule, clipping and batch for every strategy of a sweep;
    a strategy without the file's precision says so (its row's error), the others take it."""
    from parallel_lab.errors import ConfigError

    # One of each kind (the rest share these code paths).
    strategies = {"fp32.json": ("single", "pp", "zero3"), "bf16.json": ("ddp", "fsdp", "tp")}
    bf16 = ISSUE_13_DS_CONFIG
    fp32 = {k: v for k, v in bf16.items() if k != "bf16"}
    keys = ("global_batch", "grad_accum", "grad_clip", "optimizer", "lr", "betas", "eps", "weight_decay")
    keys += ("lr_scheduler",)
    for content, name in ((fp32, "fp32.json"), (bf16, "bf16.json")):
        path = _file(tmp_path, content, name)
        seen = {}
        for strategy in strategies[name]:
            try:
                cfg = _validated(tmp_path / strategy, f"strategy={strategy}", f"trainer.recipe={path}")
            except ConfigError as exc:
                assert content is bf16 and f"strategy={strategy} has no bf16 mode" in str(exc), exc
                continue
            seen[strategy] = tuple(str(cfg.trainer[k]) for k in keys)
            precision = cfg.strategy.get("precision", cfg.strategy.get("mixed_precision", "fp32"))
            assert precision == ("bf16" if content is bf16 else "fp32"), strategy
        assert len(set(seen.values())) == 1, seen  # one training recipe for every row
        expected = (str(content["train_batch_size"]), "1", str(content["gradient_clipping"]), "adamw")
        assert next(iter(seen.values()))[:4] == expected
        assert set(seen) == set(strategies[name]) - {"tp"}  # tp has no bf16 mode
