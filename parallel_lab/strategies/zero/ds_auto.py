"""``"auto"`` in a DeepSpeed config, filled from this run's own config (parent only).

A config written for the Hugging Face Trainer / Accelerate says ``"auto"`` wherever the trainer is
to decide (transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``fill_match`` and
``trainer_config_finalize``). Here the trainer is this run's config, so every ``"auto"`` gets the
value of the run setting that plays the Trainer argument's part, by the same rules:

=============================================  ==============================================
key path in the file                           value (HF's source in brackets)
=============================================  ==============================================
optimizer.params.lr / betas / eps /            trainer.lr / betas / eps / weight_decay
weight_decay (/ momentum, SGD)                 (learning_rate, adam_beta1+2, adam_epsilon, ...)
train_batch_size                               trainer.global_batch; or micro x world_size x
                                               accumulation when the file gives the micro-batch
train_micro_batch_size_per_gpu                 train_batch_size / (world_size x accumulation)
                                               (per_device_train_batch_size)
gradient_accumulation_steps                    trainer.grad_accum
gradient_clipping                              trainer.grad_clip (max_grad_norm; 0 = off)
bf16.enabled / fp16.enabled / amp.enabled      the run's precision is bf16 / fp16 / never (apex)
scheduler.params.<name>                        trainer.lr_scheduler_params.<name> when the command
                                               line sets it, else: warmup_max_lr = trainer.lr,
                                               warmup_min_lr = 0 (HF's constant), total_num_steps
                                               = trainer.steps (num_training_steps);
                                               warmup_num_steps = trainer.warmup_steps (HF's
                                               get_warmup_steps: warmup_steps, else ceil(
                                               warmup_ratio x steps), the ratio 0 by default; the
                                               run's warm-up steps, left out of the timings, are
                                               these); 0 is refused: DeepSpeed's schedules take >= 1
zero_optimization.reduce_bucket_size           hidden_size^2
zero_optimization.stage3_prefetch_bucket_size  int(0.9 x hidden_size^2)
zero_optimization.stage3_param_persistence_    10 x hidden_size
threshold
zero_optimization.stage                        the strategy's stage (zero<N>; 0 otherwise), as
                                               Accelerate takes its zero_stage
zero_optimization.offload_*.device             strategy.offload (Accelerate's offload devices)
=============================================  ==============================================

hidden_size: HF reads ``model.config.hidden_size`` (or ``max(hidden_sizes)``, the stage widths of
its CNNs). These models have no such config, so it is read off the built model: the widest output of
any layer (``Linear.out_features``, ``Conv.out_channels``), which is exactly those HF numbers for
these two families: 256 for ``cnn`` (its hidden layer, fc1) and 512 for ``resnet18`` (its last
stage; HF's ResNetConfig.hidden_sizes[-1]), scaled by ``model.width``. A Linear's in_features is not
used: cnn's fc1 takes the flattened 64x4x4 map (1024), a reshape, not a layer's width.

An ``"auto"`` with no such source is refused, one line naming every such key path and what to
write instead. ``"auto"`` where DeepSpeed itself takes it as a value (``pipeline.stages``,
``data_types.keep_in_fp32_modules``) is left to DeepSpeed. Every value filled, and where it came
from, is kept in ``ds_auto`` of config.yaml (``{<file key>: {<key path>: {value: ..., from: ...}}}``)
and the workers apply exactly those values to the file (``apply_ds_auto``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from parallel_lab.errors import ConfigError

AUTO = "auto"
DEEPSPEED_OWN_AUTO = {"pipeline.stages", "data_types.keep_in_fp32_modules"}  # DeepSpeed resolves these
BATCH_KEYS = ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu")  # fill order
HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum")  # optimizer.params.<k> <- trainer.<k>
MAX_LINE = 278  # + "parallel_lab: error: " stays under 300 characters


@dataclass
class Resolution:
    data: dict  # the file with every "auto" filled
    entries: dict = field(default_factory=dict)  # key path -> {"value": ..., "from": ...}


def auto_paths(node, prefix: tuple = ()) -> list[tuple]:
    """Key paths (tuples) of every "auto" in the file, DeepSpeed's own "auto" values left out."""
    if isinstance(node, str):
        return [prefix] if node == AUTO and dotted(prefix) not in DEEPSPEED_OWN_AUTO else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [path for key, value in items for path in auto_paths(value, (*prefix, key))]


def dotted(path: Sequence) -> str:
    return ".".join(str(p) for p in path)


def _get(data, path: Sequence):
    for key in path:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return None
    return data


def _set(data, path: Sequence, value) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hidden_size(model_cfg: DictConfig) -> tuple[int, str]:
    """(width, where): the widest output of any Linear or Conv layer of the model (meta device)."""
    import torch

    from parallel_lab.models import build_meta_model

    widest, where = 0, ""
    for name, module in build_meta_model(model_cfg).named_modules():
        if isinstance(module, torch.nn.Linear):
            width, attr = module.out_features, "out_features"
        elif isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            width, attr = module.out_channels, "out_channels"
        else:
            continue
        if width > widest:
            widest, where = width, f"{name}.{attr}"
    return widest, where


def run_precision(cfg: DictConfig) -> tuple[str, str]:
    """(precision, the key that says so) of this run before the file is adopted."""
    want = cfg.trainer.get("precision", "fp32")
    if want != "fp32":
        return want, "trainer.precision"
    for key in ("precision", "mixed_precision"):
        if key in cfg.strategy and cfg.strategy[key] != "fp32":
            return str(cfg.strategy[key]), f"strategy.{key}"
    return "fp32", "trainer.precision"


class _Rules:
    """The value and source of one "auto" key path, or None when nothing in this run sets it."""

    def __init__(self, cfg: DictConfig, data: dict, world: int):
        self.cfg, self.data, self.world = cfg, data, world
        self._hidden: tuple[int, str] | None = None
        self.filled: set[str] = set()  # "auto" key paths filled so far

    def hidden(self) -> tuple[int, str]:
        if self._hidden is None:
            self._hidden = hidden_size(self.cfg.model)
        return self._hidden

    def accumulation(self) -> tuple[int, str]:
        value = self.data.get("gradient_accumulation_steps")
        if _number(value) and "gradient_accumulation_steps" not in self.filled:
            return int(value), "gradient_accumulation_steps"
        return int(self.cfg.trainer.grad_accum), "trainer.grad_accum"

    def __call__(self, path: tuple):
        t, key = self.cfg.trainer, dotted(path)
        if key == "gradient_accumulation_steps":
            return int(t.grad_accum), "trainer.grad_accum"
        if key == "train_batch_size":
            micro = self.data.get("train_micro_batch_size_per_gpu")
            if _number(micro):
                accum, what = self.accumulation()
                source = f"train_micro_batch_size_per_gpu {micro} x world_size {self.world} x {what} {accum}"
                return int(micro) * self.world * accum, source
            return int(t.global_batch), "trainer.global_batch"
        if key == "train_micro_batch_size_per_gpu":
            return self.micro_batch()
        if key == "gradient_clipping":
            return float(t.grad_clip), "trainer.grad_clip"
        if len(path) == 3 and path[:2] == ("optimizer", "params") and path[2] in OPTIMIZER_KEYS:
            name = path[2]
            value = [float(b) for b in t.betas] if name == "betas" else float(t[name])
            return value, f"trainer.{name}"
        if key in ("bf16.enabled", "bfloat16.enabled", "fp16.enabled"):
            precision, source = run_precision(self.cfg)
            return precision == ("fp16" if key == "fp16.enabled" else "bf16"), f"{source}={precision}"
        if key == "amp.enabled":
            return False, "no apex amp here (trainer.precision)"
        if len(path) == 3 and path[:2] == ("scheduler", "params"):
            return self.scheduler_param(path[2])
        if key in HIDDEN_SIZE_KEYS:
            width, where = self.hidden()
            model = f"model={self.cfg.model.name} {where}"
            if key.endswith("reduce_bucket_size"):
                return width * width, f"hidden_size^2, hidden_size {width} ({model})"
            if key.endswith("prefetch_bucket_size"):
                return int(0.9 * width * width), f"0.9 x hidden_size^2, hidden_size {width} ({model})"
            return 10 * width, f"10 x hidden_size, hidden_size {width} ({model})"
        if key == "zero_optimization.stage":
            name = str(self.cfg.strategy.name)
            return (int(name.removeprefix("zero")) if name.startswith("zero") else 0), f"strategy={name}"
        if key in ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"):
            return str(self.cfg.strategy.get("offload", "none")), "strategy.offload"
        return None

    def micro_batch(self):
        batch, what = self.data.get("train_batch_size"), "train_batch_size"
        if not _number(batch) or "train_batch_size" in self.filled:
            batch, what = self.cfg.trainer.global_batch, "trainer.global_batch"
        accum, accum_what = self.accumulation()
        if batch % (self.world * accum):
            raise ConfigError(
                f'train_micro_batch_size_per_gpu="auto": {what}={batch} does not split into world_size {self.world} '
                f"x {accum_what}={accum}; pick a {what} that is a multiple of {self.world * accum}"
            )
        source = f"{what} {batch} / (world_size {self.world} x {accum_what} {accum})"
        return int(batch) // (self.world * accum), source

    def scheduler_param(self, name: str):
        t = self.cfg.trainer
        given = OmegaConf.select(t, f"lr_scheduler_params.{name}", default=None)
        if given is not None:
            value = OmegaConf.to_container(given) if OmegaConf.is_config(given) else given
            return value, f"trainer.lr_scheduler_params.{name}"
        if name == "warmup_max_lr":
            return float(t.lr), "trainer.lr"
        if name == "warmup_min_lr":
            return 0.0, "0, HF's value (set +trainer.lr_scheduler_params.warmup_min_lr to change)"
        if name == "total_num_steps":
            return int(t.steps), "trainer.steps"
        if name == "warmup_num_steps":
            return self.warmup_steps()
        return None

    def warmup_steps(self) -> tuple[int, str]:
        """HF's get_warmup_steps: its warmup_steps when > 0, else ceil(warmup_ratio x steps) with the
        ratio's default 0. trainer.warmup_steps plays warmup_steps (this project has no ratio)."""
        steps = int(self.cfg.trainer.warmup_steps)
        if steps < 1:  # HF's rule gives 0, which DeepSpeed's WarmupLR/WarmupDecayLR/WarmupCosineLR refuse
            raise ConfigError(
                'scheduler.params.warmup_num_steps="auto" is trainer.warmup_steps=0 (HF\'s warmup_steps), which '
                "DeepSpeed's warm-up schedules refuse; set trainer.warmup_steps=<n> or "
                "+trainer.lr_scheduler_params.warmup_num_steps=<n>"
            )
        return steps, "trainer.warmup_steps (HF's warmup_steps)"


def resolve_auto(key: str, path: str, data: dict, cfg: DictConfig, world: int) -> Resolution:
    """The file with every "auto" filled from cfg (the run's config before the file is adopted)."""
    autos = auto_paths(data)
    if not autos:
        return Resolution(data)
    order = {k: i for i, k in enumerate(BATCH_KEYS)}
    autos.sort(key=lambda p: order.get(dotted(p), len(order)))  # the batch keys first, in DeepSpeed's order
    original, data = data, copy.deepcopy(data)
    rules, entries, missing = _Rules(cfg, data, world), {}, []
    for auto in autos:
        try:
            found = rules(auto)
        except ConfigError as exc:
            raise ConfigError(fit(f"{key}={path}: {exc}", key, path)) from None
        if found is None:
            missing.append(dotted(auto))
            continue
        value, source = found
        _set(data, auto, value)
        rules.filled.add(dotted(auto))
        entries[dotted(auto)] = {"value": value, "from": source}
    if missing:
        raise ConfigError(_unresolved(key, path, missing))
    return Resolution(data, {dotted(p): entries[dotted(p)] for p in auto_paths(original)})  # in file order


def _unresolved(key: str, path: str, missing: list[str]) -> str:
    """One line: the key paths whose "auto" nothing here fills, and what to write instead."""
    scheduler = [m.rsplit(".", 1)[1] for m in missing if m.startswith("scheduler.params.")]
    flags = " ".join(f"+trainer.lr_scheduler_params.{name}=<value>" for name in scheduler)
    if len(scheduler) == len(missing):
        fix = f"set {flags} or write {'the values' if len(missing) > 1 else 'a value'} in the file"
    else:
        fix = "write a value in the file (or drop the key: DeepSpeed's default)" + (
            f", or set {flags}" if flags else ""
        )
    short_fix = "write values in the file" + (f" or set {flags}" if flags else "")
    why = "nothing in this run sets it"
    listed = ", ".join(missing)
    return first_fitting(
        key,
        path,
        f'{key}={path}: {listed} = "auto" has no source ({why}); fix: {fix}',
        f'{key}={path}: {listed} = "auto" has no source here; fix: {short_fix}',
    )


def first_fitting(key: str, path: str, *candidates: str) -> str:
    """The first message that fits the line (with the file's path, else its name); else the last, cut."""
    from pathlib import Path

    for message in candidates:
        for shown in (message, message.replace(f"{key}={path}", f"{key}={Path(path).name}")):
            if len(shown) <= MAX_LINE:
                return shown
    return fit(candidates[-1], key, path)


def fit(message: str, key: str, path: str) -> str:
    """The message within the line: the file's name instead of its whole path, then cut with '...'."""
    if len(message) <= MAX_LINE:
        return message
    from pathlib import Path

    message = message.replace(f"{key}={path}", f"{key}={Path(path).name}")
    return message if len(message) <= MAX_LINE else message[: MAX_LINE - 3].rstrip() + "..."


def apply_ds_auto(data: dict, entries) -> dict:
    """The file as the parent resolved it: each recorded key path set to its recorded value."""
    if not entries:
        return data
    entries = OmegaConf.to_container(entries, resolve=True) if OmegaConf.is_config(entries) else entries
    data = copy.deepcopy(data)
    for key, entry in entries.items():
        path = [int(p) if p.isdigit() else p for p in key.split(".")]
        if _get(data, path) == AUTO:
            _set(data, path, entry["value"])
    return data


def recorded(cfg: DictConfig, key: str):
    """ds_auto entries config.yaml holds for the file of `key` (strategy.ds_config, trainer.recipe)."""
    table = cfg.get("ds_auto") if isinstance(cfg, DictConfig) else None
    if not table:
        return {}
    return OmegaConf.to_container(table, resolve=True).get(key, {})
