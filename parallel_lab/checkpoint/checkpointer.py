"""``Checkpointer``: saves and restores one run's checkpoints during training.

The strategy's hooks write and read the model and optimizer state (each in its own format); this
adds every rank's trainer state (step, sampler position, RNG states, loss history), the barriers,
and the atomic commit (``manifest.commit``) and pruning on rank 0.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.checkpoint.full_state import consolidate
from parallel_lab.checkpoint.manifest import (
    TMP_PREFIX,
    CheckpointError,
    checkpoint_name,
    commit,
    complete_checkpoints,
    read_manifest,
    step_of,
)
from parallel_lab.checkpoint.policy import pick_checkpoint, run_identity
from parallel_lab.protocol import default_checkpoint_dir


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
    resharded_from: dict | None = None  # trainer.reshard=true: the layout that wrote it


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
        self.initialized_from: dict | None = None  # trainer.init_from, once loaded

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
        self.strategy.state.save(tmp)
        torch.save(
            {
                "step": steps_done,
                "batches_consumed": batches_consumed,
                "rng": rng_state(self.env.device),
                "history": history,
            },
            tmp / trainer_file(self.env.rank),
        )
        if fault_hook:
            fault_hook()  # fault.at=checkpoint: die with this checkpoint half-written
        _barrier()
        if self.env.is_main:
            self.last_bytes = commit(tmp, final, steps_done, run_identity(self.cfg))
            self._prune(steps_done)
        _barrier()
        self.save_seconds.append(time.perf_counter() - started)
        return final

    def _prune(self, steps_done: int) -> None:
        """Keep the newest keep_checkpoints up to this step (never the one just written)."""
        for old in [p for p in complete_checkpoints(self.root) if step_of(p) <= steps_done][self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def restore(self) -> Resumed | None:
        """Load the checkpoint trainer.resume names (collective); None when starting fresh."""
        started = time.perf_counter()
        choice = pick_checkpoint(self.cfg, self.env.restart_count) if self.env.is_main else None
        explicit = Path(str(self.cfg.trainer.resume)).expanduser()
        # Rank 0 decides; the others learn the step and whether it is trainer.resume's folder or
        # one in checkpoint_dir, so every rank loads the same folder.
        step, from_resume = _broadcast_ints(
            choice[1]["step"] if choice else -1, int(bool(choice) and choice[0] == explicit)
        )
        if step < 0:
            self._init_from()
            return None
        path = explicit if from_resume else self.root / checkpoint_name(step)
        if self.cfg.trainer.get("reshard"):
            return self._restore_resharded(path, started)
        self.strategy.state.load(path)
        state = torch.load(path / trainer_file(self.env.rank), map_location="cpu", weights_only=True)
        if state["step"] != step:
            raise CheckpointError(
                f"checkpoint '{path}': {trainer_file(self.env.rank)} says step {state['step']}, "
                f"complete.json says {step}; trainer.resume=never to start fresh"
            )
        set_rng_state(state["rng"], self.env.device)
        self.load_seconds = time.perf_counter() - started
        return Resumed(step=step, batches_consumed=state["batches_consumed"], path=path, history=state["history"])

    def _init_from(self) -> None:
        """trainer.init_from: a fresh run (step 0, data from the start) with outside weights, and
        Adam's state with trainer.init_optimizer=true, scattered by the strategy as a reshard is."""
        t = self.cfg.trainer
        if not t.get("init_from"):
            return
        from parallel_lab.checkpoint.outside import read_outside

        started = time.perf_counter()
        outside = read_outside(t.init_from, self.cfg.model, bool(t.init_optimizer))
        self.strategy.state.load_full(outside.model, outside.optim)
        self.load_seconds = time.perf_counter() - started
        self.initialized_from = {"path": str(t.init_from), "format": outside.format, "optimizer": bool(outside.optim)}

    def _restore_resharded(self, path: Path, started: float) -> Resumed:
        """trainer.reshard=true: every rank reads the checkpoint's full state offline (any writer,
        any world size) and the strategy scatters it into its own layout. A rank the source did not
        have takes rank 0's RNG state (the data order does not depend on it: batches_consumed does)."""
        manifest = read_manifest(path)
        full = consolidate(path, self.cfg.model, manifest)  # lazy: loop state now, tensors on demand
        if self.strategy.state.load_resharded_natively(path, full.format):
            via = "the library's own resharding"
        else:
            self.strategy.state.load_full(full.model, full.optim)
            via = "full state, streamed"
        set_rng_state(full.rng[self.env.rank] if self.env.rank < len(full.rng) else full.rng[0], self.env.device)
        self.load_seconds = time.perf_counter() - started
        run = manifest.get("run", {})
        source = {key: run.get(key) for key in ("strategy", "strategy_options", "world_size")}
        return Resumed(
            step=full.step,
            batches_consumed=full.batches_consumed,
            path=path,
            history=full.history,
            resharded_from={**source, "step": full.step, "format": full.format, "via": via},
        )
