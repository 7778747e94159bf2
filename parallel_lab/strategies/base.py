"""The Strategy interface every parallelism plugs into.

A strategy is one small class (a module under ``parallel_lab/strategies/``, or a folder where it
has helpers) plus one yaml file in ``conf/strategy/``. It receives a single-device model and an
optimizer factory, wraps or splits them (its ``setup``), and owns backward and the optimizer step.
The generic loop in ``parallel_lab.worker.train`` never asks which strategy it is running.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel_lab.comm.counter import CommCounter
from parallel_lab.config.choices import choice_error
from parallel_lab.errors import ConfigError, one_line
from parallel_lab.worker.dist_env import DistEnv, init_process_group

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
# The hooks that say where this rank's model state lives: how it is saved and loaded, gathered for
# the parity check, and accounted for in memory. No default: a sharded strategy that inherited a
# replicated one would save only rank 0's shard and report full-model memory without a word.
STATE_HOOKS = (
    "save_checkpoint",
    "load_checkpoint",
    "full_parameters",
    "memory_after_backward",
    "memory_after_step",
    "analytic_memory",
)


@dataclass
class StrategyOptions:
    """Options every strategy yaml has. Subclasses add their own fields (``strategy.<key>``)."""

    name: str = "?"  # the registered name (strategy=<name>), set by the yaml


class Strategy(abc.ABC):
    """Base class: one process per data-parallel rank, plain forward/backward/step, no communication.
    Where the model state lives is each strategy's to say (``STATE_HOOKS``; ``ReplicatedModel``
    for strategies whose every rank holds all of it)."""

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
            # As plain values: a key added with +strategy.<key> must not pass as part of the schema.
            merged = OmegaConf.merge(schema, OmegaConf.to_container(cfg.strategy, resolve=True))
        except OmegaConfBaseException as exc:
            message = choice_error(exc, prefix="strategy.")
            raise ConfigError(message or f"strategy '{cfg.strategy.get('name')}': {one_line(exc.msg)}") from None
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

    # ----- model state: required, see STATE_HOOKS (checkpoint/ owns atomicity and the barriers) -----
    @abc.abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write this rank's part of the model and optimizer state into directory."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Restore what save_checkpoint wrote (collective where saving was)."""

    @abc.abstractmethod
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the full (unsharded) model in the single model's order; collective."""

    # The loop measures memory twice on the last step and merges the two (disjoint) reports:
    # gradients exist only until the optimizer step frees or zeroes them, optimizer state only
    # from the first optimizer step on. Neither hook may issue a collective or touch a value.
    @abc.abstractmethod
    def memory_after_backward(self) -> dict[str, int]:
        """Bytes of parameters and gradients (param_bytes, grad_bytes, ...) this rank holds after
        the last backward, before the optimizer step."""

    @abc.abstractmethod
    def memory_after_step(self) -> dict[str, int]:
        """Bytes of optimizer state (optim_bytes, ...) this rank holds after the last optimizer step."""

    @abc.abstractmethod
    def analytic_memory(self, num_params: int) -> dict[str, int]:
        """What the textbook says this rank should hold (ZeRO paper, arXiv 1910.02054), same keys."""

    # ----- prediction (parallel_lab.plan): from the meta-device model, before any process starts -----
    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
        """The bytes of model state rank ``rank`` will report (the keys of memory_after_backward and
        memory_after_step), predicted from the model's shapes (meta device) by following what this
        strategy's implementation allocates: flat buffers, padding, shards. None: no prediction.
        ``cfg`` is validated; its world_size may exceed this machine's (the planner's scale mode)."""
        return None

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
        """Bytes per step this rank issues, by collective, counted as ``comm/counter.py`` counts
        them (an all-reduce of B bytes is 2B). None: no prediction."""
        return None

    def extra_metrics(self) -> dict:
        """Strategy-specific numbers to add to metrics.json (e.g. replicas, bubble fraction)."""
        return {}

    def mesh_dims(self) -> dict[str, int] | None:
        """{name: size} of the 2-D device mesh this run is laid out on (``strategies/mesh.py``),
        None for a flat world; metrics.json then counts communication per mesh dimension."""
        return None

    def teardown(self) -> None:
        """Drop every reference to model state so the process group can close cleanly."""
        self.model = None
        self.optimizer = None
