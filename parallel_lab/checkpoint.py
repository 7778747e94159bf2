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

import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.errors import ConfigError

COMPLETE = "complete.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
# What must match between the run that wrote a checkpoint and the run that loads it.
COMPAT_KEYS = ("strategy", "world_size", "model", "global_batch", "grad_accum", "seed")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message says which one and what to do."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    return {"strategy": cfg.strategy.name, "world_size": cfg.world_size, "model": cfg.model.name,
            "global_batch": t.global_batch, "grad_accum": t.grad_accum, "seed": t.seed}


def read_manifest(path: Path) -> dict:
    """complete.json of a checkpoint, after checking every file it lists; CheckpointError if not."""
    path = Path(path)
    fix = "point trainer.resume at another checkpoint, or trainer.resume=never to start fresh"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist; {fix}")
    manifest_path = path / COMPLETE
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
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
        if theirs.get(key) != ours[key]:
            raise CheckpointError(
                f"checkpoint '{path}' was written with {key}={theirs.get(key)} but this run has {key}={ours[key]}; "
                f"resume with the same {key}, or trainer.resume=never to start fresh")


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint folders under root, newest (most steps) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def pick_checkpoint(cfg: DictConfig, warn=None) -> tuple[Path, dict] | None:
    """The checkpoint trainer.resume asks for: None to start fresh.

    auto: the newest complete checkpoint under trainer.checkpoint_dir that passes its checks
    (a corrupt one is reported and the previous one tried); <path>: exactly that one, or an error.
    """
    warn = warn or (lambda msg: print(f"parallel_lab: warning: {msg}", file=sys.stderr, flush=True))
    resume = str(cfg.trainer.resume)
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        manifest = read_manifest(path)
        check_compatible(manifest, cfg, path)
        return path, manifest
    if not cfg.trainer.checkpoint_dir:  # a config built in process (tests), never through the CLI
        return None
    for path in complete_checkpoints(Path(cfg.trainer.checkpoint_dir)):
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            warn(f"skipping {exc}".split("; point trainer.resume")[0] + "; trying the previous checkpoint")
            continue
        check_compatible(manifest, cfg, path)
        return path, manifest
    return None


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
    path: Path
    history: dict  # loss history etc. recorded by the run that wrote the checkpoint


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_int(value: int) -> int:
    """Rank 0's choice, so every rank loads the same checkpoint even if they would see different files."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.broadcast(t, src=0)
    return int(t.item())


class Checkpointer:
    """Saves and restores one run's checkpoints; the strategy's hooks do the model/optimizer part."""

    def __init__(self, cfg: DictConfig, env, strategy) -> None:
        self.cfg = cfg
        self.env = env
        self.strategy = strategy
        self.root = Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir or ".") / "checkpoints")
        self.every = cfg.trainer.checkpoint_every
        self.keep = cfg.trainer.keep_checkpoints
        self.save_seconds: list[float] = []  # wall time of each save, barriers included
        self.load_seconds: float | None = None
        self.last_bytes = 0  # size of the newest checkpoint written (rank 0)

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and (steps_done % self.every == 0 or steps_done == self.cfg.trainer.steps)

    def save(self, steps_done: int, history: dict, fault_hook=None) -> Path:
        started = time.perf_counter()
        final = self.root / checkpoint_name(steps_done)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier write
            tmp.mkdir(parents=True)
        _barrier()
        self.strategy.save_checkpoint(tmp)
        torch.save({"step": steps_done, "batches_consumed": steps_done, "rng": rng_state(self.env.device),
                    "history": history if self.env.is_main else {}}, tmp / trainer_file(self.env.rank))
        if fault_hook:
            fault_hook()  # fault.at=checkpoint: die with this checkpoint half-written
        _barrier()
        if self.env.is_main:
            self._commit(tmp, final, steps_done)
            self._prune()
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
        if final.exists():  # e.g. trainer.resume=never over an older run's checkpoints
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self) -> Resumed | None:
        """Load the checkpoint trainer.resume names (collective); None when starting fresh."""
        started = time.perf_counter()
        choice = pick_checkpoint(self.cfg) if self.env.is_main else None
        step = _broadcast_int(choice[1]["step"] if choice else -1)
        if step < 0:
            return None
        path = choice[0] if choice else self._path_for(step)
        self.strategy.load_checkpoint(path)
        state = torch.load(path / trainer_file(self.env.rank), map_location="cpu", weights_only=True)
        if state["step"] != step:
            raise CheckpointError(f"checkpoint '{path}': {trainer_file(self.env.rank)} says step {state['step']}, "
                                  f"complete.json says {step}; trainer.resume=never to start fresh")
        set_rng_state(state["rng"], self.env.device)
        history = torch.load(path / trainer_file(0), map_location="cpu", weights_only=True)["history"]
        self.load_seconds = time.perf_counter() - started
        return Resumed(step=step, path=path, history=history)

    def _path_for(self, step: int) -> Path:
        resume = str(self.cfg.trainer.resume)
        return Path(resume).expanduser() if resume not in ("auto", "never") else self.root / checkpoint_name(step)


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
        manifest = read_manifest(Path(t.resume))
        check_compatible(manifest, cfg, Path(t.resume))
        if manifest["step"] >= t.steps:
            raise ConfigError(f"checkpoint '{t.resume}' is already at step {manifest['step']} and trainer.steps="
                              f"{t.steps}; raise trainer.steps above {manifest['step']} to train further")
