"""``PlanRules``: what the parent knows of a strategy before any process starts, from its config
alone (nothing runs): its options (``Options``) and the rules they must keep, the mesh it lays the
world out on, and what the planner (``parallel_lab.plan``) predicts of it. Every method is a
classmethod of ``cfg``; a strategy names its rules in ``Strategy.plan`` and keeps them beside it in
a module that imports no torch at import time (``ddp_rules.py``, ``zero/rules.py``, registered with
``@register_rules``): the parent refuses bad input before torch is imported (a model, when a rule
needs one, is built inside the rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

from omegaconf import DictConfig

from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.options import StrategyOptions

if TYPE_CHECKING:
    import torch

# The planner's counter of the bytes autograd saves for backward in one forward of a module (batch,
# sample shape, whether the loss is computed there), in the run's compute precision: handed to
# activation_bytes (strategies sit below plan/ and cannot import it).
SavedBytes = Callable[["torch.nn.Module", int, tuple, bool], int]
SAMPLE_SHAPE = (3, 32, 32)  # one CIFAR image


@dataclass(frozen=True)
class ComputeShape:
    """How one rank's share of a step's compute is laid out (``PlanRules.compute_shape``); the planner
    times it as ``slots`` forward+backward passes of ``micro_batch`` samples, each ``flop_share`` of
    the whole model's FLOPs."""

    micro_batch: int  # samples per forward+backward pass on this rank
    slots: int  # passes one after another per step (pipeline: its schedule's slots, bubble included)
    flop_share: float = 1.0  # the part of the model's FLOPs this rank computes per pass
    calls_per_collective: int | None = None  # calls of each collective per step, when not one per step
    note: str | None = None  # what the planner shows beside the prediction
    # Wrapper units whose Python hooks run around each pass (FSDP's units, ZeRO-3's modules: gather,
    # reshard and reduce copies, DTensor dispatch), and whether the optimizer steps DTensor shards
    # (each tensor's update pays DTensor's dispatch): the step-time model prices both per unit/tensor.
    hooked_units: int = 0
    dtensor_optimizer: bool = False
    # A data-parallel strategy's own bucketing (manual_ddp bucketed): the post-accumulate-grad hooks
    # each pass calls (one per parameter) and the buckets handed to its communication thread per
    # step: priced per call from the calibration's ``bucketing`` (plan/hook_calibration.py).
    grad_hooks: int = 0
    handoffs: int = 0


@dataclass(frozen=True)
class ClusterLayout:
    """What the cluster planner (``parallel_lab.plan.cluster``) needs of a strategy at GPU scale
    (``PlanRules.cluster_layout``): the mesh, how far the data-parallel ranks shard the model state
    (ZeRO's stages, arXiv 1910.02054), the pipeline's schedule, and which collectives it schedules
    under compute (``overlapped_collectives``)."""

    dims: MeshDims
    shard_stage: int = 0  # 0 replicas; 1 optimizer state sharded; 2 and gradients; 3 and parameters
    shard_ways: int = 1  # data-parallel ranks one copy of the model state is sharded over (consecutive ones)
    schedule: str | None = None  # pipeline schedule (pp/schedules.py names); None: no pipeline
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    microbatches: int = 1  # forward+backward passes per step on each rank (pipeline micro-batches or grad_accum)
    sequence_parallel: bool = False  # tp's token regions hold tokens/tp (arXiv 2205.05198)
    overlapped: frozenset[str] = frozenset()  # collectives issued while backward (or forward) still computes
    # ZeRO-3's hooks release a module's parameters after every forward, the one full recomputation
    # repeats in backward too: they are gathered a third time per pass (FSDP keeps them for backward).
    regathers_on_recompute: bool = False


class PlanRules:
    """Defaults: one process per data-parallel rank, the whole model on each, nothing predicted."""

    Options: ClassVar[type] = StrategyOptions  # strategy.<key>: the dataclass of its options (options.py)
    single_process: ClassVar[bool] = False  # True: the run always uses exactly one process
    needs_process_group: ClassVar[bool] = True
    degree_key: ClassVar[str | None] = None  # strategy.<key> that, times strategy.replicate, makes the world
    ranks_differ: ClassVar[bool] = False  # True: ranks hold and send different things, each is planned
    # Ways this strategy all-reduces gradients that ``bench allreduce`` times side by side:
    # label -> strategy.* overrides ({} for strategies that do not all-reduce gradients).
    allreduce_variants: ClassVar[dict[str, list[str]]] = {}
    # True: each data-parallel rank's BatchNorm layers are synchronised under model.norm=syncbatch
    # (every rank reads its own samples: ddp, manual_ddp, fsdp, zero); False: refused (norm_refusal).
    syncs_batchnorm: ClassVar[bool] = False
    # True: strategy.precision=bf16 computes on per-forward bf16 copies of the fp32 weights
    # (strategies/precision.py Bf16Compute: single, ddp), which full recomputation cannot redo.
    weight_copies: ClassVar[bool] = False

    # ----- validation and layout -----
    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """Strategy-specific rules on the type-checked options; raise ConfigError with a one-line fix."""

    @classmethod
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """Why this strategy cannot train ``model.norm`` as asked (one line: why, and the fix), or
        None. SyncBatchNorm synchronises a data-parallel group: one process needs none (plain
        BatchNorm already sees the whole batch), a strategy with several must say how it applies
        (``syncs_batchnorm``; the runtime's ``Norm`` part converts the layers) or it is refused here."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch" or cls.single_process or cls.syncs_batchnorm:
            return None
        return (
            f"model.norm=syncbatch: strategy={cfg.strategy.name} has no data-parallel group to synchronise "
            f"BatchNorm over; use model.norm=batch (docs/batchnorm.md)"
        )

    @classmethod
    def reshard_refusal(cls, cfg: DictConfig) -> str | None:
        """Why trainer.reshard=true cannot continue a run under this config (one line), or None."""
        return None

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        """How the world is laid out (``strategies/mesh.py``): by default every rank a data-parallel replica."""
        return MeshDims(replicate=cfg.world_size)

    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        """How many ways the global batch is split."""
        return cls.dims(cfg).data_parallel_size

    # ----- the planner's rules -----
    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float | None:
        """Per-step communication volume per rank in units of Ψ fp32 parameter bytes, as the ZeRO
        paper derives it (2 for an all-reduce of the gradients, 3 for ZeRO-3); None: no formula applies."""
        return None

    @classmethod
    def cluster_layout(cls, cfg: DictConfig) -> ClusterLayout:
        """The layout at ``cfg.world_size`` GPUs (the cluster planner sets it to ``plan.gpus``): by
        default replicas, one pass per ``trainer.grad_accum`` micro-batch."""
        return ClusterLayout(
            dims=cls.dims(cfg), microbatches=cfg.trainer.grad_accum, overlapped=cls.overlapped_collectives(cfg)
        )

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
        from parallel_lab.models import input_shape

        return saved(model, micro, input_shape(model), True), micro

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """Collectives (the counter's names, comm/counter.py) this strategy issues while backward still
        computes: the planner's lower bound hides them behind backward. None by default."""
        return frozenset()

    @classmethod
    def collective_calls(cls, cfg: DictConfig, model: torch.nn.Module) -> dict[str, int]:
        """Calls per step of a collective (the counter's names) where it is not one call per bucket
        of ``strategy.bucket_mb`` (or one per step; DDP and manual_ddp count their own buckets here):
        the step-time model pays latency per call (plan/steptime.py). {}: the buckets decide."""
        return {}

    @classmethod
    def comm_impl(cls, cfg: DictConfig) -> str:
        """Whose collectives carry the traffic, for the planner's alpha-beta fits: ``gloo``
        (torch.distributed) or ``hand`` (comm/collectives.py)."""
        return "gloo"

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
        """The bytes of model state rank ``rank`` will report (the keys of ``Memory.after_backward``
        and ``Memory.after_step``), predicted from the model's shapes (meta device) by following what
        this strategy's implementation allocates: flat buffers, padding, shards. None: no prediction.
        ``cfg`` is validated; its world_size may exceed this machine's (the planner's scale mode)."""
        return None

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
        """Bytes per step this rank issues, by collective, counted as ``comm/counter.py`` counts
        them (an all-reduce of B bytes is 2B). None: no prediction."""
        return None

    @classmethod
    def predict_buffer_bytes(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> int:
        """The buffer bytes rank ``rank`` will hold, from the meta model: every rank holds every
        buffer whole (no strategy here shards them); pipeline stages override."""
        return sum(b.numel() * b.element_size() for b in model.buffers())
