"""A DeepSpeed JSON config, taken as DeepSpeed would take it (parent only).

Two keys read one: ``strategy.ds_config=<file>`` (a ``zero<N>`` run: the whole file) and
``trainer.recipe=<file>`` (any strategy: the file's optimizer, LR schedule, clipping, precision and
batch, so every row of a sweep trains the same way). The file is parsed and checked by DeepSpeed's
own ``DeepSpeedConfig`` (with this run's data-parallel size), so a file DeepSpeed refuses is refused
here, in one line, before any process starts. What the file sets becomes the run's settings:

=============================================  ==============================================
file                                           run setting (shown in config.yaml)
=============================================  ==============================================
train_batch_size / micro / accumulation        trainer.global_batch, trainer.grad_accum
                                               (DeepSpeed resolves the missing ones)
gradient_clipping                              trainer.grad_clip
optimizer Adam / AdamW (adam_w_mode)           trainer.optimizer=adamw (or adam), lr, betas,
                                               eps, weight_decay: torch's optimizer, as
                                               DeepSpeed's own ``torch_adam`` path builds it
optimizer SGD                                  trainer.optimizer=sgd, lr, momentum, weight_decay
scheduler <type> + params                      trainer.lr_scheduler, trainer.lr_scheduler_params:
                                               DeepSpeed's class (or torch's) of that name,
                                               stepped after every optimizer step, as DeepSpeed
bf16.enabled                                   strategy.precision=bf16 (zero, single, ddp) /
                                               strategy.mixed_precision=bf16 (fsdp)
zero_optimization.stage                        must be the strategy's (zero<stage>)
offload_optimizer/offload_param cpu,           strategy.offload=cpu
legacy cpu_offload
=============================================  ==============================================

``"auto"`` (a config written for the Hugging Face Trainer / Accelerate) is first filled from this
run's own config by the Hugging Face rules (``ds_auto.py``; what was filled, and from what, is
config.yaml's ``ds_auto``); an "auto" nothing here can fill is refused naming its key path.

A key the user set explicitly on the command line that disagrees with the file is a conflict;
every conflict is listed in one line with the fix (``trainer.lr_scheduler_params.<name>`` against
the file's ``scheduler.params.<name>`` too). Keys the user did not set take the file's value.
What DeepSpeed refuses is one line under 300 characters naming each offending key path, why and
the fix (``ds_refusal.py``); ``PARALLEL_LAB_VERBOSE=1`` prints DeepSpeed's own message above it.
Optimizer: DeepSpeed's config ``Adam`` is its FusedAdam C++ kernel (a ~1 min compile on CPU) in
AdamW mode; here torch's Adam/AdamW with the same hyper-parameters runs it (DeepSpeed's
``torch_adam: true``), on every strategy alike.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.zero.ds_auto import MAX_LINE, fit, resolve_auto

ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad"}
SGD_KEYS = {"lr", "momentum", "weight_decay", "dampening", "nesterov"}
SUPPORTED_OPTIMIZERS = "Adam, AdamW or SGD"


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if duplicated:
        raise ValueError(f"duplicate key {duplicated[0]!r}")
    return dict(pairs)


def read_ds_file(key: str, path: str) -> dict:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}={path} does not exist; pass the path of a DeepSpeed JSON config")
    try:
        data = json.loads(file.read_text(), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        message = f"{key}={path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file"
        raise ConfigError(fit(message, key, path)) from None
    except ValueError as exc:  # DeepSpeed refuses duplicate keys too
        raise ConfigError(fit(f"{key}={path} has a {exc}; keep one", key, path)) from None
    if not isinstance(data, dict):
        message = f'{key}={path} is not a JSON object; a DeepSpeed config is {{"key": value, ...}}'
        raise ConfigError(fit(message, key, path))
    return data


def deepspeed_view(key: str, path: str, data: dict, dp_size: int, defaults: dict):
    """DeepSpeed's own parse (``DeepSpeedConfig``) of the file at this data-parallel size; batch
    keys the file leaves out come from ``defaults`` (the trainer's), as the run will pass them."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    from deepspeed.runtime.config import DeepSpeedConfig

    class _AtWorldSize(DeepSpeedConfig):
        # DeepSpeedConfig reads the world size from an initialised process group; the parent has
        # none, so the batch arithmetic gets the run's data-parallel size here.
        def _configure_train_batch_size(self):
            self.world_size = dp_size
            super()._configure_train_batch_size()

    from parallel_lab.strategies.zero.ds_refusal import batch_problem, deepspeed_refusal

    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if not any(k in data for k in batch_keys):
        data = {**data, **defaults}
    problem = batch_problem(data, dp_size)  # DeepSpeed's arithmetic, named key by key
    if problem:
        raise ConfigError(fit(f"{key}={path} is refused by DeepSpeed: {problem}", key, path))
    try:
        return _quietly(lambda: _AtWorldSize(dict(data)))
    except Exception as exc:  # whatever DeepSpeed raises is the user's file
        raise ConfigError(deepspeed_refusal(key, path, data, exc)) from None


def _quietly(make):
    import logging

    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its info lines; a refusal is our one line
    try:
        return make()
    finally:
        logger.setLevel(level)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_only(cfg: DictConfig) -> bool:
    return cfg.device == "cpu" or (cfg.device == "auto" and not _has_cuda())


def optimizer_settings(key: str, path: str, name: str | None, params: dict | None) -> dict:
    """trainer.* for the file's optimizer section (empty without one)."""
    if name is None:
        return {}
    params = dict(params or {})
    lowered = name.lower()
    if lowered in ("adam", "adamw"):
        allowed, adamw = ADAM_KEYS, lowered == "adamw" or bool(params.get("adam_w_mode", True))
        settings = {"trainer.optimizer": "adamw" if adamw else "adam"}
    elif name == "SGD":  # DeepSpeed takes it from torch.optim by its exact name
        allowed, settings = SGD_KEYS, {"trainer.optimizer": "sgd"}
    else:
        raise ConfigError(
            f"{key}={path}: optimizer.type={name} is not supported here; use {SUPPORTED_OPTIMIZERS} "
            f"(torch's implementation with the file's hyper-parameters runs on every strategy)"
        )
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigError(
            f"{key}={path}: optimizer.params.{unknown[0]} is not supported for {name}; remove it "
            f"(supported: {', '.join(sorted(allowed))})"
        )
    if params.get("amsgrad") or params.get("nesterov") or params.get("dampening", 0):
        bad = next(k for k in ("amsgrad", "nesterov", "dampening") if params.get(k))
        raise ConfigError(f"{key}={path}: optimizer.params.{bad}={params[bad]} is not supported; remove it")
    for src in ("lr", "eps", "weight_decay", "momentum"):
        if src in params:
            settings[f"trainer.{src}"] = float(params[src])
    if "betas" in params:
        settings["trainer.betas"] = [float(b) for b in params["betas"]]
    return settings


def scheduler_settings(key: str, path: str, name: str | None, params: dict | None) -> dict:
    if name is None:
        return {}
    from parallel_lab.optim import scheduler_class

    if scheduler_class(name) is None:
        raise ConfigError(
            f"{key}={path}: scheduler.type={name} is unknown to DeepSpeed; use one of DeepSpeed's "
            f"(WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or a torch.optim.lr_scheduler name"
        )
    return {"trainer.lr_scheduler": name, "trainer.lr_scheduler_params": dict(params or {})}


def file_settings(key: str, path: str, cfg: DictConfig, dp_size: int) -> dict:
    """The run settings (dotted key -> value) a DeepSpeed file sets."""
    raw = read_ds_file(key, path)
    resolved = resolve_auto(key, path, raw, cfg, dp_size)  # every "auto", from this run's own config
    data = resolved.data
    t = cfg.trainer
    micro = t.global_batch // max(1, dp_size * t.grad_accum)
    defaults = {"train_batch_size": t.global_batch, "gradient_accumulation_steps": t.grad_accum}
    defaults["train_micro_batch_size_per_gpu"] = micro
    ds = deepspeed_view(key, path, data, dp_size, defaults)
    settings: dict = {}
    if any(k in data for k in defaults):
        settings["trainer.global_batch"] = int(ds.train_batch_size)
        settings["trainer.grad_accum"] = int(ds.gradient_accumulation_steps)
    # A key the file leaves out has DeepSpeed's default, as for a DeepSpeed user (clipping at 1.0):
    # taken unless the command line sets it (then no conflict: the file said nothing).
    key_or_default = "trainer.grad_clip" if "gradient_clipping" in data else "default:trainer.grad_clip"
    settings[key_or_default] = float(ds.gradient_clipping)
    raw_name = ds.optimizer_name and (data.get("optimizer") or {}).get("type")  # DeepSpeed lowercases some
    settings.update(optimizer_settings(key, path, raw_name, ds.optimizer_params))
    settings.update(scheduler_settings(key, path, ds.scheduler_name, ds.scheduler_params))
    if ds.float16_config.enabled and _cpu_only(cfg):
        raise ConfigError(
            f"{key}={path}: fp16.enabled=true is not supported by DeepSpeed on CPU; "
            f'set "bf16": {{"enabled": true}} instead (or fp16.enabled=false)'
        )
    settings["precision"] = "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32"
    settings["zero"] = ds.zero_config
    settings["stage_in_file"] = "stage" in (data.get("zero_optimization") or {})  # else the strategy's
    settings["ds_auto"] = resolved.entries
    return settings


def _explicit_keys(explicit: Sequence[str]) -> dict[str, str]:
    return {a.partition("=")[0].lstrip("+~"): a.partition("=")[2] for a in explicit if "=" in a}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _strategy_settings(key: str, path: str, cfg: DictConfig, file: dict, whole_file: bool) -> dict:
    """strategy.* the file decides: precision (where the strategy has it) and, for strategy.ds_config,
    the ZeRO stage and offload. A setting the strategy cannot honour is refused naming it."""
    name, settings = cfg.strategy.name, {}
    precision = file.pop("precision")
    zero = file.pop("zero")
    stage_in_file = file.pop("stage_in_file")
    if "precision" in cfg.strategy:
        settings["strategy.precision"] = precision
    elif "mixed_precision" in cfg.strategy:
        settings["strategy.mixed_precision"] = precision
    elif precision != "fp32":
        raise ConfigError(
            f"{key}={path} enables {precision} but strategy={name} has no {precision} mode (it trains in fp32); "
            f"drop {name} from the sweep or disable {precision} in the file"
        )
    if whole_file:
        if stage_in_file and zero.stage != int(name.removeprefix("zero")):
            settings["strategy.name"] = f"zero{int(zero.stage)}"
        devices = {_device(zero.offload_optimizer), _device(zero.offload_param)} - {"none"}
        if devices - {"cpu"}:
            raise ConfigError(
                f"{key}={path}: zero_optimization offload to {sorted(devices - {'cpu'})[0]} is not supported here; "
                f'use "device": "cpu" or remove the offload'
            )
        settings["strategy.offload"] = "cpu" if devices else "none"
    return settings


def _device(offload) -> str:
    """'none', 'cpu' or 'nvme' of a parsed offload section (None when absent)."""
    device = getattr(offload, "device", None) if offload is not None else None
    return str(getattr(device, "value", device) or "none")


def adopt(cfg: DictConfig, key: str, path: str, explicit: Sequence[str], whole_file: bool) -> None:
    """Set every value the file decides; refuse, in one line, every one the command line contradicts."""
    dp_size = cfg.world_size  # the sweep's world size: every strategy gets the same global batch
    try:
        file = file_settings(key, path, cfg, dp_size)
        file.update(_strategy_settings(key, path, cfg, file, whole_file))
    except ConfigError as exc:  # one line under 300 characters: the file's name if its path is long
        raise ConfigError(fit(str(exc), key, path)) from None
    entries = file.pop("ds_auto")
    with open_dict(cfg):
        table = OmegaConf.to_container(cfg.ds_auto) if cfg.get("ds_auto") else {}
        table.pop(key, None)
        cfg.ds_auto = {**table, **({key: entries} if entries else {})}
    given = _explicit_keys(explicit)
    for dotted in [k for k in file if k.startswith("default:")]:
        value = file.pop(dotted)
        if dotted.removeprefix("default:") not in given:
            OmegaConf.update(cfg, dotted.removeprefix("default:"), value, merge=False)
    conflicts = []
    for dotted, value in file.items():
        typed = "strategy" if dotted == "strategy.name" else dotted
        current = OmegaConf.select(cfg, dotted)
        if typed in given and not _same(current, value):
            conflicts.append((typed, value, current))
    conflicts += _scheduler_param_conflicts(cfg, file, given)
    if conflicts:
        # Short enough for one line with several conflicts (< 300 characters for the 4 of the catalogue).
        listed = "; ".join(f"{_file_word(k, v)} vs {k}={given[k]}" for k, v, _ in conflicts)
        stage = next((f" (use strategy={v})" for k, v, _ in conflicts if k == "strategy"), "")
        raise ConfigError(
            f"{Path(path).name} vs command line: {listed}; fix: drop the overrides{stage} or edit the file"
        )
    for dotted, value in file.items():
        if dotted != "strategy.name":
            OmegaConf.update(cfg, dotted, value, merge=False)


def _scheduler_param_conflicts(cfg: DictConfig, file: dict, given: dict[str, str]) -> list[tuple]:
    """trainer.lr_scheduler_params.<name>=v on the command line against the file's scheduler.params:
    a different value is a conflict; a name the file leaves out is added (the file is silent)."""
    params = file.get("trainer.lr_scheduler_params")
    conflicts = []
    for dotted in given:
        name = dotted.removeprefix("trainer.lr_scheduler_params.")
        if params is None or name == dotted or "." in name:
            continue
        value = OmegaConf.select(cfg, dotted)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if name not in params:
            params[name] = value
        elif not _same(params[name], value):
            conflicts.append((dotted, params[name], value))
    return conflicts


FILE_KEYS = {  # run setting -> the DeepSpeed config key that sets it (for messages)
    "strategy": "zero_optimization.stage",
    "trainer.global_batch": "train_batch_size",
    "trainer.grad_accum": "gradient_accumulation_steps",
    "trainer.grad_clip": "gradient_clipping",
    "trainer.optimizer": "optimizer.type",
    "trainer.lr_scheduler": "scheduler.type",
    "trainer.lr_scheduler_params": "scheduler.params",
}


def _file_word(key: str, value) -> str:
    """How the file says it: train_batch_size=16, bf16.enabled=true, zero_optimization.stage=0."""
    if key == "strategy":
        return f"zero_optimization.stage={str(value).removeprefix('zero')}"
    if key in ("strategy.precision", "strategy.mixed_precision"):
        return "bf16.enabled=false" if value == "fp32" else f"{value}.enabled=true"
    if key == "strategy.offload":
        return f"zero_optimization offload device={value}"
    if key.startswith("trainer.lr_scheduler_params."):
        return f"scheduler.params.{key.rsplit('.', 1)[1]}={value}"
    name = FILE_KEYS.get(key) or f"optimizer.params.{key.rsplit('.', 1)[1]}"
    return f"{name}={value}"


def adopt_ds_files(cfg: DictConfig, explicit: Sequence[str] = ()) -> None:
    """Apply trainer.recipe (any strategy) and strategy.ds_config (zero<N>) to cfg, in place."""
    recipe = OmegaConf.select(cfg, "trainer.recipe")
    if recipe:
        cfg.trainer.recipe = str(Path(recipe).expanduser().resolve())
        adopt(cfg, "trainer.recipe", recipe, explicit, whole_file=False)
    ds_config = OmegaConf.select(cfg, "strategy.ds_config")
    if ds_config:
        cfg.strategy.ds_config = str(Path(ds_config).expanduser().resolve())  # workers may start elsewhere
        adopt(cfg, "strategy.ds_config", ds_config, explicit, whole_file=True)


def check_scheduler(trainer: DictConfig) -> None:
    """Build trainer.lr_scheduler on a one-parameter optimizer of the run's kind: parameters
    DeepSpeed's (or torch's) class refuses fail here, in the parent."""
    import torch

    from parallel_lab.optim import make_scheduler, optimizer_factory, scheduler_class

    name = trainer.lr_scheduler
    where = f" (from {trainer.recipe})" if trainer.get("recipe") else ""
    if scheduler_class(name) is None:
        raise ConfigError(
            f"trainer.lr_scheduler={name}{where} is unknown to DeepSpeed; use WarmupLR, WarmupDecayLR, "
            f"WarmupCosineLR, OneCycle, LRRangeTest or a torch.optim.lr_scheduler name"
        )
    optimizer = optimizer_factory(trainer)([torch.nn.Parameter(torch.zeros(1))])
    try:
        _quietly(lambda: make_scheduler(trainer, optimizer))
    except Exception as exc:  # the class's own complaint, in one line
        message, fix = " ".join(str(exc).split()) or type(exc).__name__, "; fix the params"
        head = f"trainer.lr_scheduler={name}{where} refuses trainer.lr_scheduler_params: "
        if where and len(head + message + fix) > MAX_LINE:  # one line under 300 characters
            head = head.replace(where, f" (from {Path(trainer.recipe).name})")
        room = MAX_LINE - len(head + fix)
        message = message if len(message) <= room else message[: room - 3] + "..."
        raise ConfigError(f"{head}{message}{fix}") from None
