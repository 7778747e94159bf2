"""Validation every run goes through in the parent, and the resolved file the workers read.

The parent composes the config with Hydra, validates it here, and writes the resolved result to
``<run_dir>/config.yaml``. Workers only ever read that file (``load_run_config``), so a run started
by torchrun, the deepspeed launcher or mpirun sees exactly what the parent saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError

from parallel_lab.choices import choice_error
from parallel_lab.config.schema import (
    RANGE,
    Config,
    DataConfig,
    FaultConfig,
    LauncherConfig,
    ModelConfig,
    PlanConfig,
    Range,
    TrainerConfig,
)
from parallel_lab.errors import ConfigError, Warn, print_warning
from parallel_lab.protocol import CONFIG_FILE, default_checkpoint_dir

# Where each numeric key's Range is declared (config/schema.py), by the key's prefix.
RANGED_SECTIONS = (
    ("", Config),
    ("trainer", TrainerConfig),
    ("model", ModelConfig),
    ("data", DataConfig),
    ("launcher", LauncherConfig),
    ("fault", FaultConfig),
    ("plan", PlanConfig),
)


def _example_of(f: dataclasses.Field, rng: Range) -> tuple[Any, bool]:
    """(a value the key takes, whether it is the default): the default, or the Range's example
    where the default is null or empty."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return (rng.example, False) if default is None or default == [] else (default, True)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_one_range(cfg: DictConfig, key: str, value: Any, f: dataclasses.Field, rng: Range) -> None:
    high = float(OmegaConf.select(cfg, rng.high_key)) if rng.high_key else rng.high
    integer = str(f.type) in ("int", "Optional[int]", "<class 'int'>", "typing.Optional[int]") or rng.integer
    if isinstance(value, (list, ListConfig)):
        items = list(value)
        good = (rng.items is None or len(items) == rng.items) and all(
            _is_number(v) and (isinstance(v, int) or not integer) and rng.holds(v, high) for v in items
        )
        rule = f"{rng.items or 'a list of'} {rng.rule(integer, high, plural=True)}"
    else:
        good = _is_number(value) and rng.holds(value, high)
        rule = rng.rule(integer, high)
    if not good:
        example, is_default = _example_of(f, rng)
        shown = f"the default {key}={example}" if is_default else f"{key}={example}"
        raise ConfigError(f"{key}={value} is out of range; set {key} to {rule}{rng.note}, e.g. {shown}")


def _option_range(f: dataclasses.Field) -> Range | None:
    """A strategy option's Range: declared in its field's metadata (a Range, or its keyword arguments
    as a dict, so strategies/ need not import config/), else "finite" for a float option (a nan or
    inf bucket size is never meant); None: the strategy's validate_options checks it."""
    declared = f.metadata.get(RANGE)
    if isinstance(declared, dict):
        return Range(**declared)
    if declared is not None:
        return declared
    return Range() if str(f.type) in FLOAT_TYPES else None


FLOAT_TYPES = ("float", "Optional[float]", "<class 'float'>", "typing.Optional[float]")


def check_ranges(cfg: DictConfig, options: type | None = None) -> None:
    """Every numeric key against the Range beside its default (config/schema.py) and, given the
    strategy's Options dataclass, its options (``_option_range``): one line naming the key, the bad
    value and the values it takes, before anything is written. nan and inf are refused."""
    sections = [*RANGED_SECTIONS, *((("strategy", options),) if options is not None else ())]
    for prefix, schema in sections:
        for f in dataclasses.fields(schema):
            rng = f.metadata.get(RANGE) if schema is not options else _option_range(f)
            key = f"{prefix}.{f.name}" if prefix else f.name
            value = OmegaConf.select(cfg, key, default=None)
            if rng is not None and value is not None:
                _check_one_range(cfg, key, value, f, rng)


def _resolve_threads(t: DictConfig, requested_world: int, single_process: bool) -> int:
    """trainer.threads as the processes will use it (see TrainerConfig.threads; its range: check_ranges)."""
    if t.threads is None:
        return t.threads_per_rank * (requested_world if single_process else 1)
    return t.threads


def use_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Settings that follow from the run folder (before validation, which checks the checkpoint folder)."""
    run_dir = run_dir.resolve()
    cfg.run_dir = str(run_dir)
    if not cfg.trainer.checkpoint_dir:
        cfg.trainer.checkpoint_dir = str(default_checkpoint_dir(run_dir))
    cfg.trainer.checkpoint_dir = str(Path(cfg.trainer.checkpoint_dir).expanduser().resolve())


def _check_recompute(cfg: DictConfig, plan: type) -> None:
    """trainer.recompute recomputes transformer blocks: a model without them has nothing to recompute.
    full under single/ddp's bf16 (a bf16 copy of every weight per forward, through
    torch.func.functional_call): the recomputation runs after the copies are swapped back out,
    so it would compute with the fp32 weights (docs/vit.md, known gaps)."""
    from parallel_lab.models import RECOMPUTABLE

    mode = getattr(cfg.trainer.recompute, "value", cfg.trainer.recompute)
    if mode != "none" and cfg.model.name not in RECOMPUTABLE:
        raise ConfigError(
            f"trainer.recompute={mode} needs a model with transformer blocks (model={cfg.model.name} has none); "
            "use model=vit or trainer.recompute=none"
        )
    if mode == "full" and plan.weight_copies and cfg.strategy.get("precision") == "bf16":
        raise ConfigError(
            f"trainer.recompute=full cannot recompute strategy={cfg.strategy.name}'s per-forward bf16 weight "
            "copies; use trainer.recompute=selective, or strategy.precision=fp32"
        )


def resolve_model_sizes(model: DictConfig) -> None:
    """model=gpt: every size written out (the preset's row or the default, under what was given), so
    config.yaml records the model that ran and the strategies' rules read plain values."""
    if model.name == "gpt":
        from parallel_lab.models.gpt_sizes import gpt_sizes

        for key, value in gpt_sizes(model).items():
            model[key] = value


def check_split(cfg: DictConfig, plan: type) -> int:
    """What a run and the planner (``parallel_lab.plan``) both check, whatever the machine: the
    strategy's options (``plan``: its ``PlanRules``; a tp degree that does not divide a width, more
    pp stages than blocks...), the model, and the global batch splitting into the data-parallel
    ranks. Returns that size."""
    from parallel_lab.models import validate_model_config
    from parallel_lab.strategies.options import validate_options

    validate_model_config(cfg.model)
    resolve_model_sizes(cfg.model)
    _check_recompute(cfg, plan)
    cfg.strategy = validate_options(plan, cfg)
    refusal = plan.norm_refusal(cfg)  # BatchNorm: what this strategy can do with model.norm
    if refusal:
        raise ConfigError(refusal)
    t = cfg.trainer
    dp = plan.data_parallel_size(cfg)
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(
            f"trainer.global_batch={t.global_batch} is not divisible by data-parallel size {dp} x "
            f"trainer.grad_accum={t.grad_accum}; pick a global_batch that is a multiple of {dp * t.grad_accum}"
        )
    return dp


PRECISION_KEYS = ("precision", "mixed_precision")  # a strategy's own bf16 switch: zero/single/ddp, fsdp


def apply_precision(cfg: DictConfig, explicit: Sequence[str] = ()) -> None:
    """trainer.precision=bf16 -> the strategy's own key (strategy.precision or .mixed_precision);
    a strategy without one, or an explicit strategy key saying otherwise, is refused in one line."""
    want = cfg.trainer.get("precision", "fp32")
    name = cfg.strategy.name
    key = next((k for k in PRECISION_KEYS if k in cfg.strategy), None)
    given = {a.partition("=")[0].lstrip("+~"): a.partition("=")[2] for a in explicit if "=" in a}
    if want == "fp32":
        # The strategy's own key (or a ds_config/recipe's bf16) decides; config.yaml shows the result.
        if key is not None and cfg.strategy[key] == "bf16":
            if "trainer.precision" in given:
                raise ConfigError(f"trainer.precision=fp32 contradicts strategy.{key}=bf16; drop one of them")
            cfg.trainer.precision = "bf16"
        return
    if key is None:
        raise ConfigError(
            f"trainer.precision=bf16: strategy={name} has no bf16 mode (it trains in fp32); "
            f"use single, ddp, manual_ddp, fsdp, zero0-3, tp or pp, or drop trainer.precision"
        )
    if given.get(f"strategy.{key}", "bf16") != "bf16":
        raise ConfigError(
            f"trainer.precision=bf16 contradicts strategy.{key}={given[f'strategy.{key}']}; drop one of them"
        )
    cfg.strategy[key] = "bf16"


def _adopt_ds_files(cfg: DictConfig, explicit: Sequence[str]) -> None:
    """strategies/zero/ds_file.py's adopt_ds_files; a value a file gives a typed key outside its choices
    (fp16 to strategy=single) is refused in one line naming the file."""
    from parallel_lab.strategies.zero.ds_file import adopt_ds_files

    try:
        adopt_ds_files(cfg, explicit)
    except ValidationError as exc:
        message = choice_error(exc)
        if message is None:
            raise
        files = {key: OmegaConf.select(cfg, key) for key in ("trainer.recipe", "strategy.ds_config")}
        by = " and ".join(f"{key}={path}" for key, path in files.items() if path)
        raise ConfigError(f"{message} (set by {by})") from None


def _check_profile(t: DictConfig) -> None:
    """trainer.profile traces profile_steps steps right after the warm-up: they must exist."""
    if not t.profile:
        return
    after_warmup = t.steps - t.warmup_steps
    if t.profile_steps > after_warmup:
        raise ConfigError(
            f"trainer.profile_steps={t.profile_steps} is more than the {max(after_warmup, 0)} steps after warm-up "
            f"(trainer.steps={t.steps} - trainer.warmup_steps={t.warmup_steps}); raise trainer.steps to "
            f"{t.warmup_steps + t.profile_steps} or lower trainer.profile_steps"
        )


def validate(
    cfg: DictConfig,
    run_dir: Path | None = None,
    explicit: Sequence[str] = (),
    warn: Warn = print_warning,
    reach_hosts: bool = False,
) -> DictConfig:
    """Resolve derived values and check every cross-field rule. Returns a plain resolved config.
    ``explicit``: the command line's overrides, so a DeepSpeed JSON file (strategy.ds_config,
    trainer.recipe) can tell the user's explicit choices (a conflict) from defaults (the file wins).
    ``warn``: where warnings go (a check that runs again later passes one that drops them).
    ``reach_hosts``: probe the hosts torchrun will reach through launcher.remote_shell (the command
    line asks once a run: config/hosts.py ``check_reachable``)."""
    if run_dir is not None:
        use_run_dir(cfg, run_dir)
    from parallel_lab.strategies import get_strategy_rules

    _adopt_ds_files(cfg, explicit)
    apply_precision(cfg, explicit)
    plan = get_strategy_rules(cfg.strategy.name)  # torch-free: bad input is refused before torch loads
    check_ranges(cfg, plan.Options)
    ws, t = cfg.world_size, cfg.trainer
    _check_profile(t)
    if t.lr_scheduler:
        from parallel_lab.strategies.zero.ds_file import check_scheduler

        check_scheduler(t)
    if cfg.launcher.max_restarts and cfg.launcher.name != "torchrun":
        raise ConfigError(
            f"launcher.max_restarts={cfg.launcher.max_restarts} needs launcher=torchrun (launcher="
            f"{cfg.launcher.name} does not restart workers); add launcher=torchrun or drop max_restarts"
        )
    for key in ("ulp_jitter_seed", "grad_ulp_seed", "noise_rerun"):
        if t[key] is not None and cfg.strategy.name != "single":
            raise ConfigError(
                f"trainer.{key}={t[key]} is for noise-floor reruns of the baseline; "
                "use it with strategy=single, or drop it"
            )
    requested_world = ws
    from parallel_lab.config.hosts import resolve_hosts

    resolve_hosts(cfg, requested_world, plan.single_process)
    if plan.single_process:
        ws = cfg.world_size = 1
    t.threads = _resolve_threads(t, requested_world, plan.single_process)
    dp = check_split(cfg, plan)
    from parallel_lab.data import validate_data_config

    _match_model_and_data(cfg)
    validate_data_config(cfg.data, cfg.trainer)
    _check_data_files(cfg)
    from parallel_lab.checkpoint import validate_checkpoint_config

    _check_elastic_worlds(cfg)
    elastic = cfg.launcher.get("min_nodes") is not None  # a re-formed group reshards its checkpoint
    refusal = plan.reshard_refusal(cfg) if t.reshard or elastic else None
    if refusal:
        raise ConfigError(refusal)
    validate_checkpoint_config(cfg)
    if reach_hosts:  # before the memory estimate, which imports torch
        from parallel_lab.config.hosts import check_reachable

        check_reachable(cfg)
    from parallel_lab.config.devices import resolve_device
    from parallel_lab.config.resources import check_machine_fits

    resolve_device(cfg, warn)
    check_machine_fits(cfg, t.global_batch // (dp * t.grad_accum), warn)  # last: every value is known good
    return cfg


def _match_model_and_data(cfg: DictConfig) -> None:
    """model=gpt reads token ids (data=tokens), the image models images. data.seq and data.vocab
    left null take the model's (a text file's vocabulary is its 256 byte values); the gpt's context
    must be the data's sequence length and its vocabulary hold every token the data has."""
    model, data = cfg.model, cfg.data
    if (model.name == "gpt") != (data.name == "tokens"):
        fix = "use data=tokens" if model.name == "gpt" else "use model=gpt, or data=synthetic|cifar10"
        kind = "token ids" if model.name == "gpt" else "images"
        raise ConfigError(f"model={model.name} reads {kind}, not data={data.name}; {fix}")
    if data.name != "tokens":
        return
    from parallel_lab.data.specs import BYTE_VOCAB

    if data.seq is None:
        data.seq = model.seq
    if data.vocab is None:
        data.vocab = BYTE_VOCAB if data.get("path") else model.vocab
    if data.seq != model.seq:
        raise ConfigError(
            f"data.seq={data.seq} differs from model.seq={model.seq}; drop data.seq (it takes the model's) "
            f"or set model.seq={data.seq}"
        )
    if data.vocab > model.vocab:
        raise ConfigError(
            f"model.vocab={model.vocab} is smaller than the data's vocabulary ({data.vocab}); "
            f"set model.vocab={data.vocab} or more"
        )


def _check_data_files(cfg: DictConfig) -> None:
    """data=cifar10: the tarball's md5 and, unless it is the official file, its members, read here in
    the parent so a damaged file never reaches a rank (data/cifar10.py check_tarball)."""
    if cfg.data.name == "cifar10":
        from parallel_lab.data.cifar10 import check_tarball

        check_tarball(cfg.data, DataConfig.md5)


def _check_elastic_worlds(cfg: DictConfig) -> None:
    """launcher.min_nodes: every world torchrun may re-form (min_nodes..nodes hosts) must split the
    global batch, which stays what it is so the loss curve continues; and without checkpoints there
    is nothing to continue from."""
    launcher, t = cfg.launcher, cfg.trainer
    if launcher.get("min_nodes") is None:
        return
    for hosts in range(launcher.min_nodes, launcher.nodes + 1):
        world = hosts * launcher.nproc_per_node
        if t.global_batch % (world * t.grad_accum):
            raise ConfigError(
                f"launcher.min_nodes={launcher.min_nodes}: a group re-formed on {hosts} host(s) has {world} ranks, "
                f"which do not split trainer.global_batch={t.global_batch}; use a global batch every such world divides"
            )
    if t.checkpoint_every <= 0:
        raise ConfigError(
            f"launcher.min_nodes={launcher.min_nodes} re-forms the group from the newest checkpoint, but "
            "trainer.checkpoint_every=0 writes none; set trainer.checkpoint_every (e.g. 10)"
        )


def write_run_config(cfg: DictConfig) -> Path:
    """Write the resolved <run_dir>/config.yaml workers read (cfg validated with its run_dir)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    partial = path.with_name(f".{CONFIG_FILE}.partial")
    OmegaConf.save(cfg, partial, resolve=True)
    partial.replace(path)  # whole or absent: ranks started by another launcher may be waiting for it
    return path


def load_run_config(path: str | Path) -> DictConfig:
    """What a worker reads: the config the parent validated and wrote, resolved to plain values (no
    schema types: the parent's checks already ran, and a worker must not compose again)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass <run_dir>/config.yaml written by the parent")
    loaded = OmegaConf.load(path)
    return loaded
