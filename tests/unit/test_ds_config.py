"""Bring your own DeepSpeed: a ds_config.json taken as DeepSpeed takes it, and DeepSpeed's flags;
in-process (the parent's composition and validation, and refusals before anything starts). The
files trained for real: tests/integration/test_ds_config.py."""

from __future__ import annotations

import argparse
import json

import pytest
from omegaconf import OmegaConf

from parallel_lab.cli.ds_args import _parser, overrides_from_deepspeed_args
from parallel_lab.strategies.zero.ds_config import build_ds_config
from tests.support.cli import assert_one_clean_line, run_cli
from tests.support.ds_configs import (
    HF_RUN,
    HF_ZERO3,
    HIDDEN,
    ISSUE_13_DS_CONFIG,
    assert_resolved,
    ds_file,
    validated,
)


def test_the_issues_file_is_taken_unedited(tmp_path):
    """DeepSpeed's CIFAR example file: every setting it makes is the run's, shown in config.yaml."""
    ds = ISSUE_13_DS_CONFIG
    path = ds_file(tmp_path, ds)
    cfg = validated(tmp_path, "strategy=zero0", f"strategy.ds_config={path}", "world_size=2")
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
    path = ds_file(tmp_path, {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum})
    cfg = validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", f"world_size={world}")
    assert (cfg.trainer.global_batch, cfg.trainer.grad_accum) == (micro * accum * world, accum)
    assert build_ds_config(cfg, cfg.strategy)["train_micro_batch_size_per_gpu"] == micro
    # The file is silent on clipping: DeepSpeed's default applies, unless the command line sets it.
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert cfg.trainer.grad_clip == GRADIENT_CLIPPING_DEFAULT
    explicit = validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", "trainer.grad_clip=0")
    assert explicit.trainer.grad_clip == 0


def test_command_line_agreeing_with_the_file_and_legacy_offload(tmp_path):
    """An explicit value equal to the file's is no conflict; legacy cpu_offload=true means offload."""
    content = {"train_batch_size": 32, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    path = ds_file(tmp_path, content)
    cfg = validated(tmp_path, "strategy=zero2", f"strategy.ds_config={path}", "trainer.global_batch=32")
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
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 3}})
    assert overrides_from_deepspeed_args(["--deepspeed", "--deepspeed_config", path, "trainer.steps=2"]) == [
        "strategy=zero3",
        f"strategy.ds_config={path}",
        "trainer.steps=2",
    ]
    assert overrides_from_deepspeed_args(["--local_rank=1", "strategy=zero1"]) == ["strategy=zero1"]


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
        path = ds_file(tmp_path, content, name)
        seen = {}
        for strategy in strategies[name]:
            try:
                cfg = validated(tmp_path / strategy, f"strategy={strategy}", f"trainer.recipe={path}")
            except ConfigError as exc:
                assert content is bf16 and f"strategy={strategy} has no bf16 mode" in str(exc), exc
                continue
            seen[strategy] = tuple(str(cfg.trainer[k]) for k in keys)
            precision = cfg.strategy.get("precision", cfg.strategy.get("mixed_precision", "fp32"))
            assert precision == ("bf16" if content is bf16 else "fp32"), strategy
        assert len(set(seen.values())) == 1, seen  # one training recipe for every row
        expected = (str(content["train_batch_size"]), "1", str(content["gradient_clipping"]), "adamw")
        assert next(iter(seen.values()))[:4] == expected
        assert set(seen) == set(strategies[name])  # tp's bf16: strategy.precision (Megatron's)


def test_hf_auto_values_come_from_this_runs_config(tmp_path):
    """strategy.ds_config, --deepspeed_config and trainer.recipe fill the same "auto" values from the
    run's own settings (config.yaml's ds_auto), and DeepSpeed gets the filled file."""
    path = ds_file(tmp_path, HF_ZERO3, "hf_zero3.json")
    whole = validated(tmp_path / "a", "strategy=zero3", f"strategy.ds_config={path}", *HF_RUN)
    assert_resolved(whole, "strategy.ds_config")
    assert whole.strategy.offload == "cpu" and whole.strategy.precision == "fp32"
    run = build_ds_config(whole, whole.strategy)  # what the worker hands DeepSpeed
    zero = run["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (HIDDEN**2, int(0.9 * HIDDEN**2))
    assert zero["stage3_param_persistence_threshold"] == 10 * HIDDEN
    assert (run["fp16"]["enabled"], run["bf16"]["enabled"], run["train_micro_batch_size_per_gpu"]) == (False, False, 8)
    assert "auto" not in json.dumps(run)

    flags = overrides_from_deepspeed_args(["--deepspeed", "--deepspeed_config", path, *HF_RUN])
    assert flags[:2] == ["strategy=zero3", f"strategy.ds_config={path}"]
    by_flag = validated(tmp_path / "b", *flags)
    assert OmegaConf.to_container(by_flag.ds_auto) == OmegaConf.to_container(whole.ds_auto)

    for strategy in ("single", "ddp"):  # a recipe: the same training whatever the strategy
        recipe = validated(tmp_path / strategy, f"strategy={strategy}", f"trainer.recipe={path}", *HF_RUN)
        assert_resolved(recipe, "trainer.recipe")


def test_hf_auto_follows_the_model_precision_and_batch(tmp_path):
    """hidden_size is the model's (resnet18: 512, its last stage); bf16.enabled the run's precision;
    the micro-batch splits the global batch over world_size x grad_accum; an explicit command-line
    value against a number in the file's schedule is a conflict."""
    path = ds_file(tmp_path, HF_ZERO3, "hf_zero3.json")
    common = ("strategy=zero3", f"strategy.ds_config={path}", "+trainer.lr_scheduler_params.warmup_num_steps=3")
    cfg = validated(
        tmp_path / "a",
        *common,
        "model=resnet18",
        "trainer.precision=bf16",
        "trainer.global_batch=24",
        "trainer.grad_accum=3",
        "world_size=4",
    )
    auto = {k: v["value"] for k, v in cfg.ds_auto["strategy.ds_config"].items()}
    assert auto["zero_optimization.reduce_bucket_size"] == 512**2
    assert auto["zero_optimization.stage3_param_persistence_threshold"] == 5120
    assert (auto["bf16.enabled"], auto["fp16.enabled"], cfg.strategy.precision) == (True, False, "bf16")
    assert (auto["train_batch_size"], auto["gradient_accumulation_steps"]) == (24, 3)
    assert auto["train_micro_batch_size_per_gpu"] == 2 and cfg.trainer.global_batch == 24
    # offload_*.device "auto" follows strategy.offload (Accelerate's rule); the file here says cpu.
    offload = {
        **HF_ZERO3["zero_optimization"],
        "offload_param": {"device": "auto"},
        "offload_optimizer": {"device": "auto"},
    }
    auto_offload = ds_file(tmp_path, {**HF_ZERO3, "zero_optimization": offload}, "auto_offload.json")
    cfg = validated(tmp_path / "b", "strategy=zero3", f"strategy.ds_config={auto_offload}", *common[2:])
    assert (
        cfg.strategy.offload == "none" and cfg.ds_auto["strategy.ds_config"]["zero_optimization.offload_param.device"]
    )
    fixed = {**HF_ZERO3, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    fixed_path = ds_file(tmp_path, fixed, "fixed.json")
    from parallel_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps=10 vs"):
        validated(tmp_path / "c", "strategy=zero3", f"strategy.ds_config={fixed_path}", *common[2:])


def test_hf_auto_warmup_is_hfs_rule_on_this_runs_warmup_steps(tmp_path):
    """issue 32: "warmup_num_steps": "auto" as HF's Trainer fills it (get_warmup_steps: its warmup_steps,
    the ratio's default 0), from trainer.warmup_steps, recorded with its source; a command-line value
    still wins."""
    path = ds_file(tmp_path, HF_ZERO3, "hf_zero3.json")
    for steps in (2, 5):
        cfg = validated(tmp_path / str(steps), *ZERO3_AT(path), f"trainer.warmup_steps={steps}")
        auto = cfg.ds_auto["strategy.ds_config"]
        assert (auto["scheduler.params.warmup_num_steps"].value, auto["scheduler.params.warmup_num_steps"]["from"]) == (
            steps,
            "trainer.warmup_steps (HF's warmup_steps)",
        )
        assert cfg.trainer.lr_scheduler_params.warmup_num_steps == steps
    given = validated(tmp_path / "given", *ZERO3_AT(path), "+trainer.lr_scheduler_params.warmup_num_steps=7")
    assert given.ds_auto["strategy.ds_config"]["scheduler.params.warmup_num_steps"].value == 7


def ZERO3_AT(path: str) -> tuple[str, ...]:  # reads as the ZERO3 overrides with the file
    return tuple(o.replace("{path}", path) for o in ZERO3)


FP16_KEYS_IN_BF16 = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
PUBLISHED_BF16 = {  # a published config: fp16's loss-scaling keys copied into its bf16 block
    "train_batch_size": 16,
    "bf16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {"stage": 2},
}


ZERO2 = ("strategy=zero2", "strategy.ds_config={path}")
ZERO3 = ("strategy=zero3", "strategy.ds_config={path}")
REFUSED = {  # id: (file, overrides ({path}: the file), texts the one line must hold)
    "bf16-block-with-fp16-keys": (PUBLISHED_BF16, ZERO2, (*(f"bf16.{k}" for k in FP16_KEYS_IN_BF16), "fp16")),
    "bf16-block-with-fp16-keys-as-recipe": (
        PUBLISHED_BF16,
        ("strategy=ddp", "trainer.recipe={path}"),
        (*(f"bf16.{k}" for k in FP16_KEYS_IN_BF16), "fp16"),
    ),
    "unknown-zero-key-and-bf16-key": (
        {
            "train_batch_size": 16,
            "bf16": {"enabled": True, "hysteresis": 2},
            "zero_optimization": {"stage": 2, "overlap_comms": True},
        },
        ZERO2,
        ("bf16.hysteresis", "zero_optimization.overlap_comms", "overlap_comm?"),
    ),
    "bad-offload-device": (
        {"train_batch_size": 16, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
        ZERO2,
        ("zero_optimization.offload_optimizer.device='gpu'", "'cpu'"),
    ),
    "batch-as-a-string": ({"train_batch_size": "16"}, ZERO2, ("train_batch_size='16'", "positive integer")),
    "auto-warmup-of-0": (  # HF's rule gives 0 here; DeepSpeed's warm-up schedules refuse it
        HF_ZERO3,
        (*ZERO3, "trainer.warmup_steps=0"),
        (
            'scheduler.params.warmup_num_steps="auto" is trainer.warmup_steps=0',
            "+trainer.lr_scheduler_params.warmup_num_steps=<n>",
        ),
    ),
    "auto-without-a-source-by-flag": (
        {**HF_ZERO3, "zero_optimization": {**HF_ZERO3["zero_optimization"], "allgather_bucket_size": "auto"}},
        ("--deepspeed", "--deepspeed_config={path}", "+trainer.lr_scheduler_params.warmup_num_steps=1"),
        ("zero_optimization.allgather_bucket_size", "write a value"),
    ),
    "auto-micro-batch-not-dividing": (
        HF_ZERO3,
        (*ZERO3, "trainer.global_batch=15", "+trainer.lr_scheduler_params.warmup_num_steps=1"),
        ("train_micro_batch_size_per_gpu", "trainer.global_batch=15"),
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_file_is_one_line_naming_every_key_path(tmp_path, case):
    """Each refusal: exit 2, one line under 300 characters naming each offending key path, why and
    the fix, nothing written, DeepSpeed's own text only with PARALLEL_LAB_VERBOSE=1."""
    content, overrides, named = REFUSED[case]
    path = ds_file(tmp_path, content, "ds_config.json")
    overrides = [o.replace("{path}", path) for o in overrides]
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *overrides, check=False, timeout=120)
    line = assert_one_clean_line(result, run_dir, named)
    print(len(line), line)
    assert result.returncode == 2 and not run_dir.exists(), "a run folder was written"
    assert len(line) < 300, (len(line), line)
    assert "validation error" not in result.stderr and "Extra inputs" not in result.stderr
    if case == "bf16-block-with-fp16-keys":
        verbose = run_cli(run_dir, *overrides, check=False, timeout=120, env={"PARALLEL_LAB_VERBOSE": "1"})
        assert "5 validation errors for DeepSpeedBF16Config" in verbose.stderr
        assert verbose.stderr.rstrip().endswith(line) and not run_dir.exists()
