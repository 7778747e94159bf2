"""Which checkpoint a run resumes from, and whether it may: ``trainer.resume`` and ``trainer.checkpoint_*``.

``auto`` takes the newest checkpoint that passes its checks (a damaged one is skipped with a
warning for the previous one); ``<path>`` exactly that one or a one-line error; ``never`` none.
After a torchrun restart the newest checkpoint the run wrote itself wins, whatever ``resume`` says.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint.manifest import CheckpointError, complete_checkpoints, init_from_error, read_manifest
from parallel_lab.errors import ConfigError, print_warning

# What must match between the run that wrote a checkpoint and the run that loads it: the model
# state's layout (strategy, its options, world size) and the batch sequence (data, batch, seed).
COMPAT_KEYS = (
    "strategy",
    "strategy_options",
    "world_size",
    "model",
    "data",
    "data_size",
    "optimizer",
    "global_batch",
    "grad_accum",
    "seed",
)
# How the state is laid out, not what is trained: trainer.reshard=true lets these differ (the full
# state is re-cut for the new layout; grad_accum splits the same global batch differently).
LAYOUT_KEYS = ("strategy", "strategy_options", "world_size", "grad_accum")


def run_identity(cfg: DictConfig) -> dict:
    """The settings a checkpoint must agree on with the run that resumes from it."""
    t = cfg.trainer
    return {
        "strategy": cfg.strategy.name,
        "strategy_options": OmegaConf.to_container(cfg.strategy, resolve=True),
        "world_size": cfg.world_size,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "data_size": cfg.data.size,
        "optimizer": t.optimizer,
        "global_batch": t.global_batch,
        "grad_accum": t.grad_accum,
        "seed": t.seed,
        # Not in COMPAT_KEYS (older checkpoints lack it): what the full state's reader builds the
        # model's names and shapes from, and compared when both sides have it.
        "model_config": OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True),
    }


def check_compatible(manifest: dict, cfg: DictConfig, path: Path) -> None:
    ours = run_identity(cfg)
    theirs = manifest.get("run", {})
    reshard = bool(cfg.trainer.get("reshard"))
    keys = [k for k in COMPAT_KEYS if not (reshard and k in LAYOUT_KEYS)]
    if theirs.get("model_config") is not None:
        keys.append("model_config")
    for key in keys:
        if theirs.get(key) == ours[key]:
            continue
        name, then, now = key, theirs.get(key), ours[key]
        if isinstance(then, dict) and isinstance(now, dict):  # name the one strategy option that differs
            missing = "<absent>"
            sub = next((k for k in sorted(set(then) | set(now)) if then.get(k, missing) != now.get(k, missing)), "?")
            name, then, now = f"strategy.{sub}", then.get(sub, missing), now.get(sub, missing)
        if name == "model_config":  # name the one model option that differs
            sub = next((k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)), "?")
            name, then, now = f"model.{sub}", then.get(sub), now.get(sub)
        layout = "" if reshard or key not in LAYOUT_KEYS else " (or add trainer.reshard=true to re-cut it)"
        raise CheckpointError(
            f"checkpoint '{path}' was written with {name}={then} but this run has {name}={now}; "
            f"resume with the same {name}{layout}, or start fresh "
            f"(trainer.resume=never, an empty trainer.checkpoint_dir)"
        )


def check_not_finished(manifest: dict, cfg: DictConfig, path: Path, restarted: bool = False) -> None:
    """A checkpoint at or past trainer.steps leaves nothing to train; only a torchrun restart after
    the last checkpoint (before metrics.json) may resume at exactly trainer.steps, to finish up."""
    step, steps = manifest["step"], cfg.trainer.steps
    if step > steps or (step == steps and not restarted):
        raise CheckpointError(
            f"checkpoint '{path}' is already at step {step} and trainer.steps={steps}; raise "
            f"trainer.steps above {step} to train further, or start fresh "
            f"(trainer.resume=never, an empty trainer.checkpoint_dir)"
        )


def newest_good_checkpoint(cfg: DictConfig, warn) -> tuple[Path, dict] | None:
    """The newest checkpoint under trainer.checkpoint_dir that passes its checks; a damaged one is
    reported and the previous one tried; all damaged is an error, not a silent fresh start."""
    root = Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else None
    candidates = complete_checkpoints(root) if root else []
    for path in candidates:
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            warn(f"skipping {exc}".split("; point trainer.resume")[0] + "; trying the previous checkpoint")
            continue
        check_compatible(manifest, cfg, path)
        return path, manifest
    if candidates:
        raise CheckpointError(
            f"every checkpoint under '{root}' is damaged; trainer.resume=never to start fresh "
            f"(or another trainer.checkpoint_dir)"
        )
    return None


def pick_checkpoint(cfg: DictConfig, restart_count: int = 0, warn=print_warning) -> tuple[Path, dict] | None:
    """The checkpoint to resume from, or None to start fresh.

    auto: the newest good checkpoint under trainer.checkpoint_dir; <path>: exactly that one, or an
    error; never: none. After a torchrun restart (restart_count > 0) the newest checkpoint this run
    wrote wins whatever trainer.resume says: going back to <path>, or to step 0, would throw away
    the steps finished since.
    """
    resume = str(cfg.trainer.resume)
    if resume == "auto" or restart_count > 0:
        found = newest_good_checkpoint(cfg, warn)
        if found:
            check_not_finished(found[1], cfg, found[0], restarted=restart_count > 0)
            return found
    if resume in ("auto", "never"):
        return None
    path = Path(resume).expanduser()
    manifest = read_manifest(path)
    check_compatible(manifest, cfg, path)
    check_not_finished(manifest, cfg, path)
    return path, manifest


def _validate_init_from(cfg: DictConfig) -> None:
    """trainer.init_from / init_optimizer: read here, in the parent, so a file that is not what it
    claims or another model's weights is one line before any process starts."""
    t = cfg.trainer
    if t.get("init_optimizer") and not t.get("init_from"):
        raise ConfigError(
            "trainer.init_optimizer=true needs trainer.init_from=<checkpoint> to take Adam's state from; "
            "add trainer.init_from or drop trainer.init_optimizer"
        )
    if not t.get("init_from"):
        return
    if str(t.resume) not in ("auto", "never"):
        raise ConfigError(
            f"trainer.init_from={t.init_from} starts a new run but trainer.resume={t.resume} continues one; "
            "keep one of them"
        )
    if t.init_optimizer and str(t.optimizer) not in ("adam", "adamw"):
        raise ConfigError(
            f"trainer.init_optimizer=true loads Adam's state, but trainer.optimizer={t.optimizer}; "
            "use trainer.optimizer=adam or drop trainer.init_optimizer"
        )
    t.init_from = str(Path(str(t.init_from)).expanduser().resolve())
    if not Path(t.init_from).exists():  # said before reading anything imports torch (~2 s)
        raise init_from_error(t.init_from, "does not exist")
    from parallel_lab.checkpoint.outside import read_outside

    read_outside(t.init_from, cfg.model, bool(t.init_optimizer))


def validate_checkpoint_config(cfg: DictConfig) -> None:
    """Parent-side checks of trainer.checkpoint_* / trainer.resume (one-line errors)."""
    t = cfg.trainer
    if not isinstance(t.checkpoint_every, int) or t.checkpoint_every < 0:
        raise ConfigError(
            f"trainer.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = no checkpoints); "
            f"e.g. trainer.checkpoint_every=10"
        )
    if not isinstance(t.keep_checkpoints, int) or t.keep_checkpoints < 1:
        raise ConfigError(
            f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1; the default 2 keeps a "
            f"fallback if the newest is damaged"
        )
    fault = cfg.fault
    if (
        fault.rank >= 0
        and fault.at == "checkpoint"
        and (
            t.checkpoint_every <= 0
            or not (fault.step % t.checkpoint_every == 0 or fault.step == t.steps)
            or fault.step <= 0
        )
    ):
        raise ConfigError(
            f"fault.at=checkpoint fault.step={fault.step} names no checkpoint (trainer.checkpoint_every="
            f"{t.checkpoint_every}); use a step that is a multiple of trainer.checkpoint_every"
        )
    resume = str(t.resume)
    if t.get("reshard") and resume in ("auto", "never"):
        raise ConfigError(
            f"trainer.reshard=true needs the checkpoint to re-cut: trainer.resume=<path to a step_* folder> "
            f"(trainer.resume={resume} names none)"
        )
    if resume not in ("auto", "never"):
        t.resume = str(Path(resume).expanduser().resolve())  # workers may start in another folder
    _validate_init_from(cfg)
    if not t.checkpoint_dir:  # a config composed in process, not for a run folder
        if t.resume not in ("auto", "never"):
            pick_checkpoint(cfg, warn=lambda msg: None)
        return
    t.checkpoint_dir = str(Path(t.checkpoint_dir).expanduser().resolve())
    existing = complete_checkpoints(Path(t.checkpoint_dir))
    if resume == "never" and existing:
        raise ConfigError(
            f"trainer.checkpoint_dir={t.checkpoint_dir} already holds {existing[0].name}; with "
            f"trainer.resume=never use an empty trainer.checkpoint_dir (or trainer.resume=auto)"
        )
    choice = pick_checkpoint(cfg, warn=lambda msg: None)
    others = [p for p in existing if resume not in ("auto", "never") and p != choice[0]]
    if others:  # after a restart the newest of these would win over the checkpoint asked for
        raise ConfigError(
            f"trainer.checkpoint_dir={t.checkpoint_dir} already holds {others[0].name}; to resume from "
            f"{t.resume} use an empty trainer.checkpoint_dir"
        )
