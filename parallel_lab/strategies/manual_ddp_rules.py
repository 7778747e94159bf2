"""``manual_ddp``'s options (``ManualDDPOptions``) and parent-side rules (``ManualDDPPlan``):
torch-free at import, the parent reads them before any process starts (strategies/planning.py).
The runtime: ``manual_ddp.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Precision, make_choice
from parallel_lab.comm.algorithms import ALGORITHMS
from parallel_lab.errors import ConfigError
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import ComputeShape
from parallel_lab.strategies.registry import register_rules
from parallel_lab.strategies.replicated_rules import ReplicatedPlan

if TYPE_CHECKING:
    from torch import nn

Allreduce = make_choice(
    "Allreduce", ALGORITHMS, "strategy.allreduce: manual_ddp's all-reduce (comm/collectives.py).", __name__
)


@dataclass
class ManualDDPOptions(StrategyOptions):
    """``strategy=manual_ddp`` options."""

    # star | ring | builtin (= dist.all_reduce, for comparison) | mpi (mpi4py Allreduce on the
    # buckets' memory; launcher=mpirun and CPU only)
    allreduce: Allreduce = Allreduce.ring
    # true: bucketed all-reduce launched from backward hooks, overlapping backward;
    # false: one all-reduce of every gradient after backward (simple, no overlap)
    bucketed: bool = True
    bucket_mb: float = 25.0  # bucket size in MiB when bucketed (> 0)
    # fp32 | bf16: forward/backward on a bf16 copy of the fp32 weights; fp32 gradients all-reduced
    # (strategies/precision.py, as ddp)
    precision: Precision = Precision.fp32


@register_rules("manual_ddp")
class ManualDDPPlan(ReplicatedPlan):
    Options = ManualDDPOptions
    syncs_batchnorm = True  # every rank reads its own samples
    weight_copies = True  # strategy.precision=bf16: Bf16Compute
    allreduce_variants = {
        "manual_ddp ring bucketed": ["strategy.allreduce=ring", "strategy.bucketed=true"],
        "manual_ddp ring after backward": ["strategy.allreduce=ring", "strategy.bucketed=false"],
    }

    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float:
        return 2.0  # one all-reduce of every gradient per step

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """Bucketed: all-reduced from our own backward hooks, as DDP does; unbucketed: after backward."""
        return frozenset({"all_reduce"}) if cfg.strategy.bucketed else frozenset()

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """Replicas' passes; bucketed, each pass also calls a gradient hook per parameter (the
        accumulation micro-batches' hooks return at once, but autograd still calls them) and each step
        hands every bucket to the communication thread and waits for it (``manual_ddp.py``)."""
        shape = super().compute_shape(cfg, model)
        if not cfg.strategy.bucketed:
            return shape
        params = [p for p in model.parameters() if p.requires_grad]
        return replace(shape, grad_hooks=len(params), handoffs=cls._buckets(cfg, model))

    @classmethod
    def collective_calls(cls, cfg: DictConfig, model: nn.Module) -> dict[str, int]:
        """One all-reduce per bucket as ``make_buckets`` cuts them (a tensor is never split), or one."""
        if cfg.world_size < 2:
            return {}
        return {"all_reduce": cls._buckets(cfg, model) if cfg.strategy.bucketed else 1}

    @classmethod
    def _buckets(cls, cfg: DictConfig, model: nn.Module) -> int:
        params = [p for p in model.parameters() if p.requires_grad]
        sizes = [p.numel() * p.element_size() for p in reversed(params)]  # backward's order, about
        return bucket_count(sizes, cfg.strategy.bucket_mb * 2**20)

    @classmethod
    def comm_impl(cls, cfg: DictConfig) -> str:
        """Our own all-reduce (comm/collectives.py; ring and star each priced from its calibration line)."""
        return "gloo" if cfg.strategy.allreduce == "builtin" else "hand"

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.allreduce == "mpi":
            cls._check_mpi_transport(cfg)
        if opts.bucket_mb <= 0:
            raise ConfigError(
                f"strategy.bucket_mb={opts.bucket_mb} must be > 0; use strategy.bucket_mb=25, "
                f"or strategy.bucketed=false for one all-reduce after backward"
            )

    @staticmethod
    def _check_mpi_transport(cfg: DictConfig) -> None:
        """MPI's COMM_WORLD exists only when mpiexec started the ranks, and mpi4py reduces host memory."""
        if cfg.launcher.name != "mpirun":
            raise ConfigError(
                f"strategy.allreduce=mpi needs the ranks started by mpiexec, but launcher={cfg.launcher.name}; "
                f"add launcher=mpirun (or use strategy.allreduce=ring|builtin)"
            )
        if cfg.device == "cuda" or (cfg.device == "auto" and _cuda_available()):
            raise ConfigError(
                f"strategy.allreduce=mpi reduces CPU tensors through numpy views, but device={cfg.device} puts the "
                f"gradients on CUDA; set device=cpu with launcher=mpirun, or use strategy.allreduce=builtin (nccl)"
            )


def bucket_count(sizes: list[int], cap_bytes: float) -> int:
    """How many buckets ``manual_ddp.make_buckets`` makes of gradients of these byte sizes (in
    bucket order): a parameter that would take the open bucket past the cap starts a new one."""
    buckets, filled = 0, 0
    for size in sizes:
        if buckets == 0 or filled + size > cap_bytes:
            buckets, filled = buckets + 1, 0
        filled += size
    return buckets


def _cuda_available() -> bool:
    import torch  # only for device=auto: whether it resolves to CUDA

    return torch.cuda.is_available()
