"""The DeepSpeed config of a ZeRO run, generated from the Hydra config so every strategy trains the same.

Every batch setting comes from ``trainer.*``: ``train_batch_size = trainer.global_batch``,
``gradient_accumulation_steps = trainer.grad_accum``, ``train_micro_batch_size_per_gpu =
global_batch / world_size / grad_accum``, and ``gradient_clipping = trainer.grad_clip`` (DeepSpeed's
own default is 1.0; 0 here means off, as for every strategy). A user's ``strategy.ds_config=<file>``
is merged under the generated settings and refused where it disagrees with them.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def micro_batch(cfg: DictConfig) -> int:
    t = cfg.trainer
    return t.global_batch // (cfg.world_size * t.grad_accum)


def build_ds_config(cfg: DictConfig, opts: DictConfig) -> dict:
    """The DeepSpeed config for this run, every batch setting taken from ``trainer.*``."""
    t = cfg.trainer
    bucket = int(opts.bucket_mb * 2**20 / PRECISION_BYTES[opts.precision])
    zero: dict = {
        "stage": opts.stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if opts.stage == 1:
        # ZeRO-1 as in the paper: gradients stay whole during backward and are reduced once at
        # the accumulation boundary (no per-bucket hooks; those make stage 1 behave like 2).
        zero.update(contiguous_gradients=False, overlap_comm=False)
    if opts.stage == 3:
        # Partition every parameter (DeepSpeed keeps ones below 100k elements whole by default,
        # which on resnet18 would leave most of the small convs replicated).
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket)
    if opts.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if opts.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    ds = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": micro_batch(cfg),
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # the toolkit's torch optimizer also drives offload
        "zero_allow_untested_optimizer": True,  # torch SGD as the client optimizer
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if opts.precision != "fp32":
        ds[opts.precision] = {"enabled": True}
    if opts.ds_config:
        ds = merge_user_config(load_user_config(opts.ds_config), ds, opts.ds_config)
    return ds


def load_user_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"strategy.ds_config={path} does not exist; pass the path of a DeepSpeed JSON config")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"strategy.ds_config={path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file"
        ) from None


def _flag(section) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def merge_user_config(user: dict, ours: dict, path: str) -> dict:
    """The user's keys stay unless they contradict the Hydra config, which is then an error."""
    checked = {  # ds_config key -> the Hydra setting that decides it
        "train_batch_size": "trainer.global_batch",
        "train_micro_batch_size_per_gpu": "trainer.global_batch / world_size / trainer.grad_accum",
        "gradient_accumulation_steps": "trainer.grad_accum",
        "gradient_clipping": "trainer.grad_clip",
    }
    for key, setting in checked.items():
        if key in user and user[key] != "auto" and float(user[key]) != float(ours[key]):
            raise ConfigError(
                f"strategy.ds_config={path} sets {key}={user[key]} but the Hydra config gives {ours[key]} "
                f"({setting}); remove {key} from the file or change {setting.split(' ')[0]}"
            )
    if "optimizer" in user or "scheduler" in user:
        raise ConfigError(
            f"strategy.ds_config={path} has an 'optimizer'/'scheduler' section; remove it: the optimizer comes "
            "from trainer.optimizer and trainer.lr so every strategy runs the same update"
        )
    user_zero = dict(user.get("zero_optimization") or {})
    if "stage" in user_zero and int(user_zero["stage"]) != ours["zero_optimization"]["stage"]:
        stage = ours["zero_optimization"]["stage"]
        raise ConfigError(
            f"strategy.ds_config={path} sets zero_optimization.stage={user_zero['stage']} "
            f"but this is strategy=zero{stage}; "
            f"use strategy=zero{user_zero['stage']} or remove the stage from the file"
        )
    for precision in ("fp16", "bf16"):
        if _flag(user.get(precision)) and precision not in ours:
            raise ConfigError(
                f"strategy.ds_config={path} enables {precision} but strategy.precision is not {precision}; "
                f"set strategy.precision={precision} or remove the {precision} section"
            )
    merged = {**user, **ours}
    merged["zero_optimization"] = {**user_zero, **ours["zero_optimization"]}
    return merged
