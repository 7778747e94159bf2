"""The Strategy interface every parallelism plugs into, and the defaults most of them share.

A strategy is one small class in its own module under ``parallel_lab/strategies/`` plus one yaml
file in ``conf/strategy/``. It receives a single-device model and an optimizer factory, wraps or
splits them (its ``setup``), and owns backward and the optimizer step. The generic loop in
``parallel_lab.worker.train`` never asks which strategy it is running.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel_lab.comm.counter import CommCounter
from parallel_lab.worker.dist_env import DistEnv, init_process_group
from parallel_lab.errors import ConfigError, one_line

REPLICA_FILE = "model_optimizer.pt"
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StrategyOptions:
    """Options every strategy yaml has. Subclasses add their own fields (``strategy.<key>``)."""

    name: str = "?"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind tensors: views into one flat buffer count once, and
    the whole buffer counts (padding included), freed storages (resized to 0) count nothing.
    This is what sharded strategies hold for real, whatever views they hand out."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return int(sum(seen.values()))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def optimizer_bytes_per_param(trainer: DictConfig) -> int:
    """fp32 optimizer state per parameter: Adam keeps two moments, SGD one momentum buffer."""
    if trainer.optimizer == "adam":
        return 8
    return 4 if trainer.momentum else 0


def _map_state(optim_state: dict, fn) -> dict:
    """An optimizer state_dict with fn(param index, tensor) applied to every per-parameter tensor
    except Adam's scalar step counter."""
    state = {index: {k: fn(index, v) if torch.is_tensor(v) and k != "step" else v for k, v in per_param.items()}
             for index, per_param in optim_state["state"].items()}
    return {**optim_state, "state": state}


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A saved local shard as the kind of tensor the parameter is (a DTensor with its layout)."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class Strategy:
    """Base class: one process per data-parallel rank, replicated model, no communication."""

    Options: ClassVar[type] = StrategyOptions
    single_process: ClassVar[bool] = False  # True: the run always uses exactly one process
    needs_process_group: ClassVar[bool] = True
    # Per-step communication volume per rank in units of Ψ fp32 parameter bytes, as the ZeRO paper
    # derives it (2 for an all-reduce of the gradients, 3 for ZeRO-3); None where no formula applies.
    comm_theory_psi: ClassVar[float | None] = None

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        self.cfg = cfg
        self.opts = cfg.strategy
        self.env = env
        self.device = env.device
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.comm = CommCounter()  # the loop turns counting on around each step

    # ----- validation (runs in the parent, before any process starts) -----
    @classmethod
    def validate_options(cls, cfg: DictConfig) -> DictConfig:
        """Type-check ``cfg.strategy`` against ``cls.Options``; unknown keys are errors."""
        try:
            schema = OmegaConf.structured(cls.Options)
            merged = OmegaConf.merge(schema, cfg.strategy)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"strategy '{cfg.strategy.get('name')}': {one_line(exc.msg)}") from None
        cls.check_options(merged, cfg)
        return merged

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """Strategy-specific rules; raise ConfigError with a one-line fix."""

    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        """How many ways the global batch is split (tensor/pipeline parallel override this)."""
        return cfg.world_size

    @classmethod
    def init_distributed(cls, env: DistEnv, timeout_s: int) -> None:
        """Create the default process group (DeepSpeed strategies use deepspeed's own init)."""
        init_process_group(env, timeout_s)

    # ----- data placement -----
    @property
    def dp_rank(self) -> int:
        return self.env.rank

    @property
    def dp_size(self) -> int:
        return self.env.world_size

    # ----- lifecycle -----
    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        self.model = model.to(self.device)
        self.optimizer = make_optimizer(self.model.parameters())

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(inputs), targets)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, micro: int, num_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the detached micro-batch loss."""
        loss = self.forward_loss(inputs, targets)
        (loss / num_micro).backward()
        return loss.detach()

    def clip_gradients(self) -> None:
        if self.cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)

    def optimizer_step(self) -> None:
        self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """The loss of the whole global batch: the mean of the data-parallel ranks' means."""
        if self.dp_size > 1:
            local_mean = local_mean.detach().clone().to(self.device)
            dist.all_reduce(local_mean, op=dist.ReduceOp.SUM)
            local_mean /= self.dp_size
        return float(local_mean)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Logits for inputs, or None on ranks that do not produce them (pipeline stages)."""
        # Unwrap DDP/DataParallel: evaluation needs no gradient sync and must not issue collectives.
        return getattr(self.model, "module", self.model)(inputs)

    def evaluate(self, batches) -> float | None:
        """Accuracy on held-out batches: this rank's (correct, total) counts, then combined."""
        counts = torch.zeros(2, dtype=torch.float64)
        for inputs, targets in batches:
            logits = self.predict(inputs.to(self.device))
            if logits is not None:
                counts += torch.tensor([(logits.argmax(1).cpu() == targets).sum().item(), len(targets)])
        counts = self.combine_eval_counts(counts.to(self.device))
        return float(counts[0] / counts[1]) if counts[1] > 0 else None

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Data-parallel ranks each scored their own shard: sum the counts over them."""
        if self.dp_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return counts

    # ----- checkpoints (parallel_lab/checkpoint.py calls these; it owns atomicity and the barriers) -----
    def unwrapped_model(self) -> torch.nn.Module:
        """The user's module inside DDP/DataParallel wrappers, whose state_dict has the plain names."""
        return getattr(self.model, "module", self.model)

    def save_checkpoint(self, directory: Path) -> None:
        """Replicated model and optimizer: every replica holds the same, so rank 0 writes one copy
        and the others wait at the checkpointer's barrier."""
        if self.env.rank == 0:
            torch.save({"model": self.unwrapped_model().state_dict(), "optimizer": self.optimizer.state_dict()},
                       directory / REPLICA_FILE)

    def load_checkpoint(self, directory: Path) -> None:
        """Every rank reads the one copy (weights_only: tensors and plain values only)."""
        state = torch.load(directory / REPLICA_FILE, map_location=self.device, weights_only=True)
        self.unwrapped_model().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_rank_shard(self, directory: Path) -> None:
        """Tensor/pipeline parallel: each rank holds a different part, so each writes its own file
        (DTensors as their local shards, so loading needs no DTensor types)."""
        torch.save({"model": {k: local_tensor(v) for k, v in self.model.state_dict().items()},
                    "optimizer": _map_state(self.optimizer.state_dict(), lambda index, value: local_tensor(value))},
                   directory / f"shard_rank{self.env.rank}.pt")

    def load_rank_shard(self, directory: Path) -> None:
        state = torch.load(directory / f"shard_rank{self.env.rank}.pt", map_location=self.device, weights_only=True)
        mine = self.model.state_dict()  # shares storage with the parameters and buffers
        if set(mine) != set(state["model"]):
            raise ConfigError(f"checkpoint '{directory}': shard_rank{self.env.rank}.pt holds "
                              f"{sorted(state['model'])}, this rank has {sorted(mine)}; resume with the same "
                              f"strategy options, or trainer.resume=never")
        with torch.no_grad():
            for name, tensor in mine.items():
                local_tensor(tensor).copy_(state["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.load_state_dict(_map_state(state["optimizer"], lambda index, value: _like(params[index], value)))

    # ----- proof -----
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the full (unsharded) model; collective on sharded strategies."""
        return [p.detach() for p in self.model.parameters()]

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank actually holds right now."""
        params = list(self.model.parameters())
        return {
            "param_bytes": tensor_bytes(params),
            "grad_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optim_bytes": optimizer_state_bytes(self.optimizer),
        }

    def analytic_memory(self, num_params: int) -> dict[str, int]:
        """What the textbook says this rank should hold (ZeRO paper, arXiv 1910.02054, fp32):
        a full replica is 4 bytes/param of weights, 4 of gradients and the optimizer's state
        (Adam: 8 = exp_avg + exp_avg_sq; SGD with momentum: 4). Sharded strategies override."""
        return {
            "param_bytes": 4 * num_params,
            "grad_bytes": 4 * num_params,
            "optim_bytes": optimizer_bytes_per_param(self.cfg.trainer) * num_params,
        }

    def extra_metrics(self) -> dict:
        """Strategy-specific numbers to add to metrics.json (e.g. replicas, bubble fraction)."""
        return {}

    def teardown(self) -> None:
        """Drop every reference to model state so the process group can close cleanly."""
        self.model = None
        self.optimizer = None
