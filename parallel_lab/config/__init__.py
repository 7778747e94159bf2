"""Hydra schemas (a ConfigStore) and the validation every run goes through in the parent.

The parent process composes the config with Hydra, validates it here, and writes the resolved
result to ``<run_dir>/config.yaml``. Workers only ever read that file (``load_run_config``), so a
run started by torchrun, the deepspeed launcher or mpirun sees exactly what the parent saw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from parallel_lab.errors import ConfigError
from parallel_lab.protocol import CONFIG_FILE, default_checkpoint_dir

MAX_WORLD_SIZE = 64  # a sane ceiling for one machine; above it is almost surely a typo
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_GROUPS = ("strategy", "model", "data", "launcher")


@dataclass
class TrainerConfig:
    steps: int = 20
    # Constant across world sizes (as in nanoGPT) so every strategy's numbers compare:
    # each data-parallel rank gets global_batch / dp_world, split again into grad_accum micro-batches.
    global_batch: int = 64
    grad_accum: int = 1
    lr: float = 1e-3
    optimizer: str = "adam"  # adam | sgd
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # 0 = off, for every strategy (DeepSpeed's own default of 1.0 is overridden)
    seed: int = 0
    warmup_steps: int = 2  # steps left out of the timing medians
    threads_per_rank: int = 1  # intra-op threads per process; one-process strategies get the total
    # Intra-op threads (torch.set_num_threads and OMP_NUM_THREADS) of every process of the run.
    # null = derived: threads_per_rank, times the requested world_size for a one-process strategy
    # (single, dp) so it uses the cores the ranks would have; an explicit n >= 1 is used as is.
    # config.yaml and metrics.json hold the resolved number.
    threads: Optional[int] = None
    progress: bool = True
    eval_batches: int = 2  # batches of held-out data for the accuracy in metrics.json (0 = skip)
    # Checkpoints (parallel_lab/checkpoint.py): every N optimizer steps and at the last step.
    checkpoint_every: int = 0  # 0 = never
    checkpoint_dir: Optional[str] = None  # default <run_dir>/checkpoints
    keep_checkpoints: int = 2  # newest complete ones kept: a damaged newest falls back to the previous
    resume: str = "auto"  # auto (newest good checkpoint, if any) | never | <path to a step_* folder>
    # Noise-floor reruns of the `single` baseline only (parallel_lab/parity.py; a sweep starts them):
    # move every initial weight one float ulp up or down, signs drawn from this seed. null = off.
    ulp_jitter_seed: Optional[int] = None


@dataclass
class ModelConfig:
    name: str = MISSING  # cnn | resnet18
    num_classes: int = 10


@dataclass
class DataConfig:
    name: str = MISSING  # synthetic | cifar10
    root: Optional[str] = None  # folder holding cifar-10-python.tar.gz (cifar10 only)
    size: int = 4096  # synthetic: number of training samples generated from the seed
    download: bool = False  # cifar10: fetch the tarball if it is missing (needs internet)
    md5: Optional[str] = "c58f30108f718f92721af3b95e74349a"  # cifar10: expected tarball md5; null skips the check


@dataclass
class LauncherConfig:
    name: str = MISSING  # spawn | torchrun | deepspeed | mpirun
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port
    max_restarts: int = 0  # torchrun only
    extra_args: list = field(default_factory=list)
    grace_s: float = 10.0  # after one rank fails, how long the others get before being killed


@dataclass
class FaultConfig:
    """Deliberate failure, for testing what a crash does: rank ``rank`` fails at step ``step``."""

    rank: int = -1  # -1 = never
    step: int = 0
    mode: str = "raise"  # raise (a Python exception) | kill (SIGKILL itself, like a lost node)
    # step: before step `step` runs; checkpoint: halfway through writing the checkpoint taken after
    # `step` steps (its files written, not yet committed). Only in the first attempt: a torchrun
    # restart (TORCHELASTIC_RESTART_COUNT > 0) runs clean, as after a real lost node.
    at: str = "step"


@dataclass
class Config:
    strategy: Any = MISSING  # validated against the strategy's own Options dataclass
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    world_size: int = 2
    device: str = "auto"  # auto | cpu | cuda
    dist_timeout_s: int = 120  # timeout of every process group
    run_dir: Optional[str] = None  # filled in by the parent
    fault: FaultConfig = field(default_factory=FaultConfig)


def register_configs() -> None:
    """Register the schema that conf/config.yaml extends (``defaults: [base_config, ...]``)."""
    ConfigStore.instance().store(name="base_config", node=Config)


def available_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """Reject ``strategy=nope`` before Hydra does, with one line instead of Hydra's page."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in CONFIG_GROUPS:
            continue
        options = available_options(key)
        for choice in value.split(","):
            if choice and choice not in options:
                raise ConfigError(
                    f"unknown {key} '{choice}'; choose one of: {', '.join(options)} ({key}=<name>)"
                )


def describe_compose_error(exc: BaseException) -> str:
    """Hydra/OmegaConf's multi-line error as one line naming the key, value and fix."""
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    keyed = [e for e in chain if getattr(e, "full_key", None)]
    cause = keyed[0] if keyed else chain[0]
    message = str(getattr(cause, "msg", None) or cause)
    first = " ".join(message.strip().splitlines()[0].split()) if message.strip() else type(cause).__name__
    where = f"'{cause.full_key}': " if keyed else ""
    return (f"bad override {where}{first}; fix the value or the key name "
            f"(python -m parallel_lab --cfg job prints every key with its current value)")


def _sweep_variants(argv: list[str]) -> list[list[str]]:
    """Override lists that together use every value of every sweep (a,b,c / range(...)) once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices = []
    for arg in argv:
        override = parser.parse_override(arg)
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()] or [arg])
        else:
            choices.append([arg])
    variants = [[options[0] for options in choices]]
    for i, options in enumerate(choices):
        for option in options[1:]:
            variants.append([*variants[0][:i], option, *variants[0][i + 1:]])
    return variants


def check_overrides_compose(argv: list[str]) -> None:
    """Compose the config with the user's overrides before Hydra runs, so a wrong type or an
    unknown key is one line (Hydra's own report is a page) and nothing is launched."""
    from hydra import compose, initialize_config_dir

    from hydra._internal.utils import get_args_parser  # Hydra's own command line, flags and all

    known, _ = get_args_parser().parse_known_args(argv)
    overrides = [a for a in known.overrides if not a.lstrip("+~").startswith("hydra")]
    register_configs()
    try:
        variants = _sweep_variants(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            for variant in variants:
                compose(config_name="config", overrides=variant)
    except Exception as exc:  # noqa: BLE001 - every Hydra/OmegaConf error becomes one line
        raise ConfigError(describe_compose_error(exc)) from None


def _check_positive(name: str, value: int, alternative: str = "") -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value} must be a positive integer; set {name}=<n> with n >= 1{alternative}")


def _check_range(name: str, value: float, low: float, high: float = math.inf, *, default: float,
                 low_open: bool = False, note: str = "") -> None:
    """Refuse nan, inf and values outside [low, high) ((low, high) with low_open), naming the default."""
    inside = math.isfinite(value) and (value > low if low_open else value >= low) and value < high
    if not inside:
        rule = f"{'>' if low_open else '>='} {low:g}" if high == math.inf else f"in [{low:g}, {high:g})"
        raise ConfigError(f"{name}={value} must be a finite number {rule}{note}; "
                          f"set {name} to one, e.g. the default {name}={default}")


def _check_numbers(cfg: DictConfig) -> None:
    """Values torch.optim, torchrun or the supervisor would only reject once the workers run."""
    t, launcher = cfg.trainer, cfg.launcher
    _check_range("trainer.lr", t.lr, 0, low_open=True, default=TrainerConfig.lr)
    _check_range("trainer.weight_decay", t.weight_decay, 0, default=TrainerConfig.weight_decay)
    _check_range("trainer.grad_clip", t.grad_clip, 0, default=TrainerConfig.grad_clip)
    if t.optimizer == "sgd":  # Adam does not read it
        _check_range("trainer.momentum", t.momentum, 0, 1, default=TrainerConfig.momentum,
                     note=" with trainer.optimizer=sgd")
    _check_range("launcher.max_restarts", launcher.max_restarts, 0, default=LauncherConfig.max_restarts)
    _check_range("launcher.grace_s", launcher.grace_s, 0, low_open=True, default=LauncherConfig.grace_s)
    _check_positive("dist_timeout_s", cfg.dist_timeout_s)


def _resolve_threads(t: DictConfig, requested_world: int, single_process: bool) -> int:
    """trainer.threads as the processes will use it (see TrainerConfig.threads)."""
    if t.threads is None:
        return t.threads_per_rank * (requested_world if single_process else 1)
    _check_positive("trainer.threads", t.threads,
                    " (or trainer.threads=null to derive it from trainer.threads_per_rank)")
    return t.threads


def use_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Settings that follow from the run folder (before validation, which checks the checkpoint folder)."""
    run_dir = run_dir.resolve()
    cfg.run_dir = str(run_dir)
    if not cfg.trainer.checkpoint_dir:
        cfg.trainer.checkpoint_dir = str(default_checkpoint_dir(run_dir))
    cfg.trainer.checkpoint_dir = str(Path(cfg.trainer.checkpoint_dir).expanduser().resolve())


def validate(cfg: DictConfig, run_dir: Path | None = None) -> DictConfig:
    """Resolve derived values and check every cross-field rule. Returns a plain resolved config."""
    if run_dir is not None:
        use_run_dir(cfg, run_dir)
    from parallel_lab.strategies import get_strategy_class

    strategy_cls = get_strategy_class(cfg.strategy.name)
    ws = cfg.world_size
    if not isinstance(ws, int) or ws < 1 or ws > MAX_WORLD_SIZE:
        raise ConfigError(
            f"world_size={ws} is out of range; use 1 <= world_size <= {MAX_WORLD_SIZE} (world_size=2)"
        )
    t = cfg.trainer
    for key in ("steps", "global_batch", "grad_accum", "threads_per_rank"):
        _check_positive(f"trainer.{key}", t[key])
    if t.optimizer not in ("adam", "sgd"):
        raise ConfigError(f"trainer.optimizer='{t.optimizer}' is unknown; use trainer.optimizer=adam or sgd")
    _check_numbers(cfg)
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device='{cfg.device}' is unknown; use device=auto, cpu or cuda")
    if cfg.fault.mode not in ("raise", "kill"):
        raise ConfigError(f"fault.mode='{cfg.fault.mode}' is unknown; use fault.mode=raise or kill")
    if cfg.launcher.max_restarts and cfg.launcher.name != "torchrun":
        raise ConfigError(f"launcher.max_restarts={cfg.launcher.max_restarts} needs launcher=torchrun (launcher="
                          f"{cfg.launcher.name} does not restart workers); add launcher=torchrun or drop max_restarts")
    if cfg.fault.at not in ("step", "checkpoint"):
        raise ConfigError(f"fault.at='{cfg.fault.at}' is unknown; use fault.at=step or checkpoint")
    if t.ulp_jitter_seed is not None and cfg.strategy.name != "single":
        raise ConfigError(f"trainer.ulp_jitter_seed={t.ulp_jitter_seed} is for noise-floor reruns of the baseline; "
                          f"use it with strategy=single, or drop it")
    requested_world = ws
    if strategy_cls.single_process:
        ws = cfg.world_size = 1
    t.threads = _resolve_threads(t, requested_world, strategy_cls.single_process)
    cfg.strategy = strategy_cls.validate_options(cfg)
    dp = strategy_cls.data_parallel_size(cfg)
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(
            f"trainer.global_batch={t.global_batch} is not divisible by data-parallel size {dp} x "
            f"trainer.grad_accum={t.grad_accum}; pick a global_batch that is a multiple of {dp * t.grad_accum}"
        )
    from parallel_lab.data import validate_data_config
    from parallel_lab.models import validate_model_config

    validate_model_config(cfg.model)
    validate_data_config(cfg.data, cfg.trainer)
    from parallel_lab.checkpoint import validate_checkpoint_config

    validate_checkpoint_config(cfg)
    from parallel_lab.config.resources import check_machine_fits

    check_machine_fits(cfg, micro_batch=t.global_batch // (dp * t.grad_accum))  # last: every value is known good
    return cfg


def write_run_config(cfg: DictConfig) -> Path:
    """Write the resolved <run_dir>/config.yaml workers read (cfg validated with its run_dir)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    OmegaConf.save(cfg, path, resolve=True)
    return path


def load_run_config(path: str | Path) -> DictConfig:
    """What a worker reads: the resolved config the parent wrote, typed by the schema."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass <run_dir>/config.yaml written by the parent")
    loaded = OmegaConf.load(path)
    return loaded
