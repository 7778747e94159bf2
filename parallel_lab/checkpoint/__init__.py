"""Checkpoints every strategy can resume from, exactly.

Layout (``trainer.checkpoint_dir``, default ``<run_dir>/checkpoints``)::

    step_00000004/                 one checkpoint: 4 optimizer steps done
        complete.json              written last; lists every file with its size and sha256
        trainer_rank<k>.pt         step, data-sampler position, RNG states, loss history
        ...                        model + optimizer, as the strategy saves them (its hooks)

How a checkpoint is written (``Checkpointer.save``): every rank writes into
``.tmp-step_00000004/``; a barrier; rank 0 hashes the files, writes ``complete.json`` (temp +
rename) and renames the folder to ``step_00000004`` (one atomic rename); a second barrier. A crash
at any point before that rename leaves only a ``.tmp-*`` folder, which resuming ignores. On load
every file is checked against ``complete.json``: a truncated or altered checkpoint is refused
(``trainer.resume=<path>``) or skipped for the previous good one (``trainer.resume=auto``).

What is saved where is the strategy's business (``Strategy.save_checkpoint``/``load_checkpoint``):
replicated strategies write one copy from rank 0, FSDP uses torch Distributed Checkpoint, ZeRO
uses DeepSpeed's own save_checkpoint/load_checkpoint, tensor/pipeline parallel write one shard
per rank. Everything is read back with ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel_lab.errors import ConfigError, print_warning
from parallel_lab.hashing import file_digest
from parallel_lab.protocol import default_checkpoint_dir

COMPLETE = "complete.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
# What must match between the run that wrote a checkpoint and the run that loads it: the model
# state's layout (strategy, its options, world size) and the batch sequence (data, batch, seed).
COMPAT_KEYS = ("strategy", "strategy_options", "world_size", "model", "data", "data_size", "optimizer",
               "global_batch", "grad_accum", "seed")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message says which one and what to do."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_identity(cfg: DictConfig) -> dict:
    """The settings a checkpoint must agree on with the run that resumes from it."""
    t = cfg.trainer
    return {"strategy": cfg.strategy.name, "strategy_options": OmegaConf.to_container(cfg.strategy, resolve=True),
            "world_size": cfg.world_size, "model": cfg.model.name, "data": cfg.data.name, "data_size": cfg.data.size,
            "optimizer": t.optimizer, "global_batch": t.global_batch, "grad_accum": t.grad_accum, "seed": t.seed}


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def read_manifest(path: Path) -> dict:
    """complete.json of a checkpoint, after checking every file it lists; CheckpointError if not."""
    path = Path(path)
    fix = "point trainer.resume at another checkpoint, or start fresh (trainer.resume=never, an empty trainer.checkpoint_dir)"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist; {fix}")
    manifest_path = path / COMPLETE
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        inside = complete_checkpoints(path)
        if inside:
            raise CheckpointError(f"'{path}' holds checkpoints, it is not one; pass one of its step_* folders, "
                                  f"e.g. trainer.resume={inside[0]}") from None
        raise CheckpointError(f"checkpoint '{path}' is incomplete (no {COMPLETE}: its write never finished); {fix}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' has a corrupt {COMPLETE} ({exc}); {fix}") from None
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is missing {rel}; {fix}")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint '{path}' is corrupt: {rel} has {file.stat().st_size} bytes, {expected['size']} were written; {fix}")
        if sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: {rel} does not match its sha256; {fix}")
    manifest["step"] = step
    return manifest


def check_compatible(manifest: dict, cfg: DictConfig, path: Path) -> None:
    ours = run_identity(cfg)
    theirs = manifest.get("run", {})
    for key in COMPAT_KEYS:
        if theirs.get(key) == ours[key]:
            continue
        name, then, now = key, theirs.get(key), ours[key]
        if isinstance(then, dict) and isinstance(now, dict):  # name the one strategy option that differs
            missing = "<absent>"
            sub = next((k for k in sorted(set(then) | set(now)) if then.get(k, missing) != now.get(k, missing)), "?")
            name, then, now = f"strategy.{sub}", then.get(sub, missing), now.get(sub, missing)
        raise CheckpointError(
            f"checkpoint '{path}' was written with {name}={then} but this run has {name}={now}; "
            f"resume with the same {name}, or start fresh (trainer.resume=never, an empty trainer.checkpoint_dir)")


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint folders under root, newest (most steps) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def check_not_finished(manifest: dict, cfg: DictConfig, path: Path, restarted: bool = False) -> None:
    """A checkpoint at or past trainer.steps leaves nothing to train; only a torchrun restart after
    the last checkpoint (before metrics.json) may resume at exactly trainer.steps, to finish up."""
    step, steps = manifest["step"], cfg.trainer.steps
    if step > steps or (step == steps and not restarted):
        raise CheckpointError(f"checkpoint '{path}' is already at step {step} and trainer.steps={steps}; raise "
                              f"trainer.steps above {step} to train further, or start fresh (trainer.resume=never, an empty trainer.checkpoint_dir)")


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
        raise CheckpointError(f"every checkpoint under '{root}' is damaged; trainer.resume=never to start fresh "
                              f"(or another trainer.checkpoint_dir)")
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


# ----- per-rank trainer state: step, sampler position, RNG, history -----

def rng_state(device: torch.device) -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # numpy's state as tensors and plain numbers, so weights_only loading needs no numpy globals
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def trainer_file(rank: int) -> str:
    return f"trainer_rank{rank}.pt"


@dataclass
class Resumed:
    step: int  # optimizer steps already done
    batches_consumed: int  # global batches the sampler has handed out: where the data resumes
    path: Path
    history: dict  # loss history etc. recorded by the run that wrote the checkpoint


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_ints(*values: int) -> list[int]:
    """Rank 0's values on every rank (the others pass placeholders)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


class Checkpointer:
    """Saves and restores one run's checkpoints; the strategy's hooks do the model/optimizer part."""

    def __init__(self, cfg: DictConfig, env, strategy) -> None:
        self.cfg = cfg
        self.env = env
        self.strategy = strategy
        self.root = Path(cfg.trainer.checkpoint_dir or default_checkpoint_dir(cfg.run_dir or "."))
        self.every = cfg.trainer.checkpoint_every
        self.keep = cfg.trainer.keep_checkpoints
        self.save_seconds: list[float] = []  # wall time of each save, barriers included
        self.load_seconds: float | None = None
        self.last_bytes = 0  # size of the newest checkpoint written (rank 0)

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and (steps_done % self.every == 0 or steps_done == self.cfg.trainer.steps)

    def save(self, steps_done: int, batches_consumed: int, history: dict, fault_hook=None) -> Path:
        started = time.perf_counter()
        final = self.root / checkpoint_name(steps_done)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier write
            tmp.mkdir(parents=True)
        _barrier()
        self.strategy.save_checkpoint(tmp)
        torch.save({"step": steps_done, "batches_consumed": batches_consumed, "rng": rng_state(self.env.device),
                    "history": history}, tmp / trainer_file(self.env.rank))
        if fault_hook:
            fault_hook()  # fault.at=checkpoint: die with this checkpoint half-written
        _barrier()
        if self.env.is_main:
            self._commit(tmp, final, steps_done)
            self._prune(steps_done)
        _barrier()
        self.save_seconds.append(time.perf_counter() - started)
        return final

    def _commit(self, tmp: Path, final: Path, steps_done: int) -> None:
        files = {}
        for file in _files_under(tmp):
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            files[str(file.relative_to(tmp))] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
        manifest = {"format": FORMAT_VERSION, "step": steps_done, "run": run_identity(self.cfg), "files": files}
        self.last_bytes = sum(f["size"] for f in files.values())
        (tmp / (COMPLETE + ".tmp")).write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp / (COMPLETE + ".tmp"), tmp / COMPLETE)
        _fsync_dir(tmp)
        old = self.root / f".old-{final.name}"
        if final.exists():  # written before a restart went back past it: move aside, then replace
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)

    def _prune(self, steps_done: int) -> None:
        """Keep the newest keep_checkpoints up to this step (never the one just written)."""
        for old in [p for p in complete_checkpoints(self.root) if step_of(p) <= steps_done][self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self) -> Resumed | None:
        """Load the checkpoint trainer.resume names (collective); None when starting fresh."""
        started = time.perf_counter()
        choice = pick_checkpoint(self.cfg, self.env.restart_count) if self.env.is_main else None
        explicit = Path(str(self.cfg.trainer.resume)).expanduser()
        # Rank 0 decides; the others learn the step and whether it is trainer.resume's folder or
        # one in checkpoint_dir, so every rank loads the same folder.
        step, from_resume = _broadcast_ints(choice[1]["step"] if choice else -1,
                                            int(bool(choice) and choice[0] == explicit))
        if step < 0:
            return None
        path = explicit if from_resume else self.root / checkpoint_name(step)
        self.strategy.load_checkpoint(path)
        state = torch.load(path / trainer_file(self.env.rank), map_location="cpu", weights_only=True)
        if state["step"] != step:
            raise CheckpointError(f"checkpoint '{path}': {trainer_file(self.env.rank)} says step {state['step']}, "
                                  f"complete.json says {step}; trainer.resume=never to start fresh")
        set_rng_state(state["rng"], self.env.device)
        self.load_seconds = time.perf_counter() - started
        return Resumed(step=step, batches_consumed=state["batches_consumed"], path=path, history=state["history"])


def validate_checkpoint_config(cfg: DictConfig) -> None:
    """Parent-side checks of trainer.checkpoint_* / trainer.resume (one-line errors)."""
    t = cfg.trainer
    if not isinstance(t.checkpoint_every, int) or t.checkpoint_every < 0:
        raise ConfigError(f"trainer.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = no checkpoints); "
                          f"e.g. trainer.checkpoint_every=10")
    if not isinstance(t.keep_checkpoints, int) or t.keep_checkpoints < 1:
        raise ConfigError(f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1; the default 2 keeps a "
                          f"fallback if the newest is damaged")
    fault = cfg.fault
    if fault.rank >= 0 and fault.at == "checkpoint" and (t.checkpoint_every <= 0 or not (
            fault.step % t.checkpoint_every == 0 or fault.step == t.steps) or fault.step <= 0):
        raise ConfigError(f"fault.at=checkpoint fault.step={fault.step} names no checkpoint (trainer.checkpoint_every="
                          f"{t.checkpoint_every}); use a step that is a multiple of trainer.checkpoint_every")
    resume = str(t.resume)
    if resume not in ("auto", "never"):
        t.resume = str(Path(resume).expanduser().resolve())  # workers may start in another folder
    if not t.checkpoint_dir:  # a config composed in process, not for a run folder
        if t.resume not in ("auto", "never"):
            pick_checkpoint(cfg, warn=lambda msg: None)
        return
    t.checkpoint_dir = str(Path(t.checkpoint_dir).expanduser().resolve())
    existing = complete_checkpoints(Path(t.checkpoint_dir))
    if resume == "never" and existing:
        raise ConfigError(f"trainer.checkpoint_dir={t.checkpoint_dir} already holds {existing[0].name}; with "
                          f"trainer.resume=never use an empty trainer.checkpoint_dir (or trainer.resume=auto)")
    choice = pick_checkpoint(cfg, warn=lambda msg: None)
    others = [p for p in existing if resume not in ("auto", "never") and p != choice[0]]
    if others:  # after a restart the newest of these would win over the checkpoint asked for
        raise ConfigError(f"trainer.checkpoint_dir={t.checkpoint_dir} already holds {others[0].name}; to resume from "
                          f"{t.resume} use an empty trainer.checkpoint_dir")
