"""The Strategy interface every parallelism plugs into: the runtime (set up, step, evaluate, tear
down), with each other concern in a part of its own that the class names.

A strategy is one small class (a module under ``parallel_lab/strategies/``, or a folder where it
has helpers) plus one yaml file in ``conf/strategy/``. It receives a single-device model and an
optimizer factory, wraps or splits them (its ``setup``), and owns backward and the optimizer step.
The generic loop in ``parallel_lab.worker.train`` never asks which strategy it is running. Beside
the runtime, the class names:

* ``Options``: its ``strategy.<key>`` dataclass (``options.py``);
* ``plan``: its parent-side rules, classmethods of the config (``planning.py``): the options'
  rules, the mesh it lays the world out on (``mesh.py``), what the planner predicts;
* ``State``: where its model state lives: save, load, reshard into, gather (``state.py``);
* ``Memory``: what a rank holds, measured and textbook (``memory.py``);
* ``Norm``: what it does to BatchNorm (``batchnorm.py``).

``State`` and ``Memory`` have no default (``STATE_HOOKS``; ``replicated.py`` for strategies whose
every rank holds the whole model).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.comm.counter import CommCounter
from parallel_lab.comm.dist_env import DistEnv, init_process_group
from parallel_lab.strategies.batchnorm import Norm
from parallel_lab.strategies.ep.groups import ep_rank
from parallel_lab.strategies.ep.rules import expert_ids
from parallel_lab.strategies.memory import Memory, local_tensor
from parallel_lab.strategies.mesh import REPLICATE, TENSOR, Mesh
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import PlanRules
from parallel_lab.strategies.state import State

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
# The parts that say where this rank's model state lives: how it is saved and loaded, gathered for
# the parity check, and accounted for in memory. No default: a sharded strategy that inherited a
# replicated one would save only rank 0's shard and report full-model memory without a word.
STATE_HOOKS = (
    "State.save",
    "State.load",
    "State.full_parameters",
    "Memory.after_backward",
    "Memory.after_step",
    "Memory.analytic",
)


class Strategy:
    """Base class: one process per data-parallel rank, plain forward/backward/step, no communication."""

    Options: ClassVar[type] = StrategyOptions
    plan: ClassVar[type[PlanRules]] = PlanRules
    State: ClassVar[type[State]] = State
    Memory: ClassVar[type[Memory]] = Memory
    Norm: ClassVar[type[Norm]] = Norm
    # The mesh dimensions along which ranks hold the same copy of every parameter (replica_parameters):
    # the replicas, and a replica's cp ranks (the same weights on their own tokens, the gradients
    # averaged over cp too). FSDP shards over shard x cp and names replicate alone.
    replica_dims: ClassVar[tuple[str, ...]] = (REPLICATE, "cp")

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        self.cfg = cfg
        self.opts = cfg.strategy
        self.env = env
        self.device = env.device
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.comm = CommCounter()  # the loop turns counting on around each step
        self.layout = self.plan.dims(cfg)  # the mesh's dimensions (strategies/mesh.py)
        self.mesh: Mesh | None = None  # built in setup by a strategy that talks over its groups
        self.dp_rank = self.layout.dp_rank(env.rank)  # which share of the global batch this rank reads
        self.dp_size = self.layout.data_parallel_size
        self.state = self.State(self)
        self.memory = self.Memory(self)
        self.norm = self.Norm(self)

    @classmethod
    def init_distributed(cls, env: DistEnv, timeout_s: int) -> None:
        """Create the default process group (DeepSpeed strategies use deepspeed's own init)."""
        init_process_group(env, timeout_s)

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
                    # argmax over the classes (dim 1): one prediction per label, a sample's or each token's
                    counts += torch.tensor([(logits.argmax(1).cpu() == targets).sum().item(), targets.numel()])
        finally:
            self.model.train(was_training)
        counts = self.combine_eval_counts(counts.to(self.device))
        return float(counts[0] / counts[1]) if counts[1] > 0 else None

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Data-parallel ranks each scored their own shard: sum the counts over them."""
        if self.dp_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return counts

    def run_comm_theory_psi(self, num_params: int) -> float | None:
        """metrics.json's ``comm_theory_psi``: the plan's formula, unless the run's own routing
        decides the volume (expert parallelism, strategies/ep/)."""
        return self.plan.comm_theory_psi(self.cfg)

    def replica_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as it holds them, each under a key naming *what* it holds: the ranks
        holding one key are data-parallel replicas of it and must end a run with the same bytes
        (``worker/replicas.py`` digests and compares them). The default, from the mesh: a parameter's
        name and the rank's coordinates along every dimension but ``replica_dims`` (a pp or FSDP
        shard is the same shard only at the same coordinates), the tp coordinate only for a
        parameter split over tp (``split_over_tp``: a norm held whole by every tp rank is one copy),
        an expert's also with the rank's ep share (experts differ between ep ranks by design:
        ``ep/groups.py``). Override where the module's parameters are not what a rank holds."""
        coords = self.layout.coords(self.env.rank)
        kept = [d for d in self.layout.sizes() if d not in self.replica_dims]
        whole = [d for d in kept if d != TENSOR]
        split = getattr(self, "shard_dims", None)  # tp's {split parameter: dim}; None: no tp split named
        experts = expert_ids(self.model) if self.layout.ep > 1 else set()
        share = f"ep={ep_rank(self.layout, self.env.rank)}," if self.layout.ep > 1 else ""
        out = {}
        for name, p in self.model.named_parameters():
            where = "".join(f"{d}={coords[d]}," for d in (kept if split_over_tp(name, p, split) else whole))
            # DeepSpeed's MoE layer marks its experts' parameters allreduce=False (zero/ds_moe.py)
            expert = id(p) in experts or getattr(p, "allreduce", True) is False
            out[f"{where}{share if expert else ''}{name}"] = local_tensor(p.detach())
        return out

    def extra_metrics(self) -> dict:
        """Strategy-specific numbers to add to metrics.json (e.g. replicas, bubble fraction)."""
        return {}

    def teardown(self) -> None:
        """Drop every reference to model state so the process group can close cleanly."""
        self.model = None
        self.optimizer = None
        self.mesh = None


def split_over_tp(name: str, p: torch.Tensor, shard_dims: dict[str, int] | None) -> bool:
    """Does this rank hold its own slice of ``p`` along tp (Megatron's split layers, Shoeybi et al.
    2019, sec. 3), or the whole of it, as every tp rank does (the norms, a row-parallel bias)? A
    DTensor says so by its placement on the mesh's tp dimension (Shard or Replicate); otherwise
    the strategy's own ``shard_dims`` by name (tp's split, the same list its gradient clipping
    reads). A strategy naming no split (None) claims nothing: its keys keep the tp coordinate."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    if TENSOR in names:
        return not p.placements[names.index(TENSOR)].is_replicate()
    return shard_dims is None or name in shard_dims
