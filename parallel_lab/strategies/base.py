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

from parallel_lab.choices import choice_error
from parallel_lab.comm.counter import CommCounter
from parallel_lab.comm.dist_env import DistEnv, init_process_group
from parallel_lab.errors import ConfigError, one_line
from parallel_lab.strategies import batchnorm

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
# The planner's counter of the bytes autograd saves for backward in one forward of a module (batch,
# sample shape, whether the loss is computed there), in the run's compute precision: handed to
# activation_bytes (strategies sit below plan/ and cannot import it).
SavedBytes = Callable[[torch.nn.Module, int, tuple, bool], int]
SAMPLE_SHAPE = (3, 32, 32)  # one CIFAR image
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


@dataclass(frozen=True)
class ComputeShape:
    """How one rank's share of a step's compute is laid out (``Strategy.compute_shape``); the planner
    times it as ``slots`` forward+backward passes of ``micro_batch`` samples, each ``flop_share`` of
    the whole model's FLOPs."""

    micro_batch: int  # samples per forward+backward pass on this rank
    slots: int  # passes one after another per step (pipeline: its schedule's slots, bubble included)
    flop_share: float = 1.0  # the part of the model's FLOPs this rank computes per pass
    calls_per_collective: int | None = None  # calls of each collective per step, when not one per step
    note: str | None = None  # what the planner shows beside the prediction


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
        self._bn_group = None  # the group BatchNorm's synchronisation uses (running_stats_group)
        self._bn_plain: bool | None = None  # the model has BatchNorm layers that are not synchronised

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
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """Why this strategy cannot train ``model.norm`` as asked (one line: why, and the fix), or
        None. SyncBatchNorm synchronises a data-parallel group: one process needs none (plain
        BatchNorm already sees the whole batch), a strategy with several must say how it applies
        (``syncs_batchnorm``) or it is refused here, before any process starts."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch" or cls.single_process or cls.syncs_batchnorm:
            return None
        return (
            f"model.norm=syncbatch: strategy={cfg.strategy.name} has no data-parallel group to synchronise "
            f"BatchNorm over; use model.norm=batch (docs/batchnorm.md)"
        )

    # True: data-parallel ranks whose BatchNorm layers model.norm=syncbatch converts (convert_batchnorm).
    syncs_batchnorm: ClassVar[bool] = False

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

    # ----- BatchNorm (strategies/batchnorm.py, docs/batchnorm.md) -----
    def running_stats_group(self) -> tuple[object, int] | None:
        """(group, source rank): the ranks that hold replicas of the same BatchNorm layers but
        feed them different samples, and whose running statistics the others copy. None: no
        such ranks (one process, or every rank sees the same samples). Default: the whole world,
        through a group of its own, so the counter can tell BatchNorm's bytes from the rest."""
        if self.single_process or not self.needs_process_group or self.dp_size < 2:
            return None
        if self._bn_group is None:  # collective: every rank reaches this at the same point
            self._bn_group = dist.new_group(list(range(dist.get_world_size())))
            self.comm.label_group(self._bn_group, batchnorm.SYNC_LABEL)
        return self._bn_group, 0

    def convert_batchnorm(self, model: torch.nn.Module) -> torch.nn.Module:
        """Before setup: model.norm=syncbatch makes every BatchNorm layer synchronised over
        running_stats_group (where there is one; single and dp keep plain BatchNorm, which
        already normalises over the whole batch). Models without BatchNorm are returned as they are."""
        from parallel_lab.models import norm_of

        if not batchnorm.batchnorm_layers(model):
            return model
        target = self.running_stats_group()  # created now, before setup, on every rank alike
        if norm_of(self.cfg.model) != "syncbatch" or target is None:
            return model
        return batchnorm.convert_sync_batchnorm(model, target[0], self.device)

    def sync_running_stats(self) -> None:
        """After each optimizer step: plain BatchNorm layers updated their running statistics from
        each rank's own samples, so the first replica's are copied to the others (as DDP's
        broadcast_buffers does, but after the step: the replicas evaluate and checkpoint the same)."""
        if self._bn_plain is None:
            self._bn_plain = any(not batchnorm.is_synced(m) for m in batchnorm.batchnorm_layers(self.model))
        target = self.running_stats_group() if self._bn_plain else None
        if target is not None:
            batchnorm.broadcast_running_stats(self.model, *target)

    def memory_buffers(self) -> dict[str, int]:
        """Bytes of the model's buffers (BatchNorm's running statistics) this rank holds."""
        return {"buffer_bytes": sum(b.numel() * b.element_size() for b in self.model.buffers())}

    @classmethod
    def predict_buffer_bytes(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> int:
        """The buffer bytes rank ``rank`` will hold, from the meta model: every rank holds every
        buffer whole (no strategy here shards them); pipeline stages override."""
        return sum(b.numel() * b.element_size() for b in model.buffers())

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
        # Eval mode: BatchNorm normalises with its running statistics, as single's does (and does
        # not update them from held-out data); GroupNorm and the cnn compute the same either way.
        was_training = self.model.training
        self.model.eval()
        try:
            for inputs, targets in batches:
                logits = self.predict(inputs.to(self.device))
                if logits is not None:
                    counts += torch.tensor([(logits.argmax(1).cpu() == targets).sum().item(), len(targets)])
        finally:
            self.model.train(was_training)
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

    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Scatter a strategy-neutral full state (``checkpoint/full_state.py``: the single model's
        state_dict, Adam's state by parameter name) into this strategy's own layout; collective
        where setup was. Used by ``trainer.reshard=true``; a strategy without it cannot be resharded into."""
        raise ConfigError(
            f"strategy={self.cfg.strategy.name} cannot load a resharded checkpoint; resume it with "
            f"its own strategy and world size (drop trainer.reshard=true)"
        )

    def load_resharded_natively(self, directory: Path, fmt: str) -> bool:
        """Load a checkpoint of another layout with a library's own resharding when one applies to
        its format (FSDP: DCP's load-time resharding of a DCP checkpoint); False: not handled here,
        the full state is scattered by load_full_state instead."""
        return False

    @classmethod
    def reshard_refusal(cls, cfg: DictConfig) -> str | None:
        """Why trainer.reshard=true cannot continue a run under this config (one line), or None."""
        return None

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

    # ----- the planner's rules (parallel_lab.plan): facts of the strategy, nothing runs -----
    degree_key: ClassVar[str | None] = None  # strategy.<key> that, times strategy.replicate, makes the world
    ranks_differ: ClassVar[bool] = False  # True: ranks hold and send different things, each is planned
    # Ways this strategy all-reduces gradients that ``bench allreduce`` times side by side:
    # label -> strategy.* overrides ({} for strategies that do not all-reduce gradients).
    allreduce_variants: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def min_global_batch(cls, cfg: DictConfig) -> int:
        """The smallest global batch this layout can split (the planner's weak scaling keeps to it)."""
        return 1

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: torch.nn.Module) -> ComputeShape:
        """Each data-parallel rank runs the whole model on its share of the batch, once per micro-batch."""
        t = cfg.trainer
        return ComputeShape(
            micro_batch=t.global_batch // (cls.data_parallel_size(cfg) * t.grad_accum), slots=t.grad_accum
        )

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: torch.nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """(bytes autograd saves for backward on this rank, the micro-batch they are for)."""
        return saved(model, micro, SAMPLE_SHAPE, True), micro

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """Collectives (the counter's names, comm/counter.py) this strategy issues while backward still
        computes: the planner's lower bound hides them behind backward. None by default."""
        return frozenset()

    @classmethod
    def comm_impl(cls, cfg: DictConfig) -> str:
        """Whose collectives carry the traffic, for the planner's alpha-beta fits: ``gloo``
        (torch.distributed) or ``hand`` (comm/collectives.py)."""
        return "gloo"

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
