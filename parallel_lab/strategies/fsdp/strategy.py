"""``fsdp``: Fully Sharded Data Parallel (torch FSDP2 ``fully_shard`` by default, FSDP1 with
``strategy.version=1``). The ZeRO idea (Rajbhandari et al., arXiv 1910.02054) in PyTorch itself.

Communication, per FSDP unit (here: every top-level block of the model that has parameters):
each rank stores 1/N of the unit's parameters; before the unit's forward (and again before its
backward) the shards are **all-gathered** into the full parameters; after backward the gradients
are **reduce-scattered**, so each rank keeps the averaged gradient of its own shard only, and the
optimizer updates only that shard. Per step a rank sends/receives about 3x the parameter bytes
(all-gather forward + all-gather backward + reduce-scatter), 1.5x DDP's all-reduce.

``strategy.sharding`` (how far it shards; the ZeRO stage it resembles):

=============  ==================================  ===========================  ===========
sharding       FSDP1 ShardingStrategy              FSDP2 fully_shard            ~ ZeRO
=============  ==================================  ===========================  ===========
``full``       FULL_SHARD                          reshard_after_forward=True   ZeRO-3
``grad_op``    SHARD_GRAD_OP                       reshard_after_forward=False  ZeRO-2
``no_shard``   NO_SHARD                            2-D mesh (replicate N x      DDP
                                                   shard 1), resharded after
                                                   forward: every rank holds
                                                   everything, grads all-reduced
=============  ==================================  ===========================  ===========

``grad_op`` keeps the gathered parameters from forward until backward (no second all-gather), so
between forward and backward a rank holds the full working copy *and* its shard; ``full`` frees
each unit's gathered parameters right after using them.

``hybrid`` is HSDP (FSDP2 only): a 2-D mesh of ``strategy.replicate`` replicas x world_size /
replicate shards (``strategies/mesh.py``). Inside a shard group (the ranks of one host) it is
``full``: all-gathers forward and backward, reduce-scatter of the gradients, 3Ψ per rank; across
the replicate dimension (between hosts) only the reduced gradient shards are all-reduced, 2Ψ/S
per rank for a shard group of S. Every rank holds 1/S of the model state, not 1/world_size: HSDP
trades memory for traffic between hosts, which is why metrics.json counts both dimensions apart
(``strategy_extras.mesh``). FSDP1's HYBRID_SHARD without a 2-D mesh silently diverges on one node
(docs/facts.md), so hybrid needs the explicit mesh and ``strategy.version=2``.

``strategy.mixed_precision=bf16`` computes forward/backward in bf16 (parameters all-gathered in
bf16, gradients reduced in fp32) while the sharded parameters and Adam states stay fp32.

The two torch APIs are two small classes, ``FSDP2`` (``v2.py``) and ``FSDP1`` (``v1.py``); this
module holds what they share, and their rules live in ``rules.py``. Memory accounting (``FSDPMemory``)
reads the real storages: the local shards of the DTensor parameters (FSDP2) or the FlatParameter
shards (FSDP1), the gathered parameter buffers that are alive at the end of forward (the moment
``grad_op`` holds the most), the sharded gradients after backward and the optimizer's state
tensors after the step.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.optim import optimizer_bytes_per_param
from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.ep.parallel import ExpertParallel, expert_parallel
from parallel_lab.strategies.fsdp.rules import FSDPPlan, fsdp_units, shard_size  # noqa: F401  (fsdp_units: re-exported)
from parallel_lab.strategies.memory import Memory, storage_bytes
from parallel_lab.strategies.mesh import REPLICATE
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.state import State

DCP_DIR = "dcp"  # torch Distributed Checkpoint files inside one of our step_* checkpoints


class FSDPState(State):
    """torch Distributed Checkpoint, each rank writing its own shards."""

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.strategy._before_state_dict()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(directory / DCP_DIR))

    def load(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from parallel_lab.checkpoint.dcp_reader import load_sharded

        state = self._sharded_state()  # the shapes and shards to fill in
        load_sharded(state, str(directory / DCP_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def load_resharded_natively(self, directory: Path, fmt: str) -> bool:
        """A DCP checkpoint (FSDP1, FSDP2 or HSDP, any world size) is loaded by DCP itself: each rank
        asks for its own shards of this run's layout and DCP reads the byte ranges that overlap
        them (load-time resharding). The DCP folder name is this module's own."""
        if fmt != "dcp" or not (directory / DCP_DIR).is_dir():
            return False
        self.load(directory)
        return True

    def load_full(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """torch's own tool: ``set_state_dict`` with full (unsharded) state dicts keyed by the
        single model's names; every rank holds the full state and keeps its shards of it (DCP's
        load-time resharding does the same from a sharded checkpoint, but only FSDP can read that)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.strategy._before_state_dict()
        model_state = dict(model_state)  # torch edits the dict it is given: every tensor, read now
        if not optim_state:
            # No Adam state (trainer.init_from without init_optimizer, a step-0 checkpoint): the
            # optimizer is left alone. set_state_dict would first create Adam's state by a step with
            # zero gradients (torch's _init_optim_state), leaving step=1 behind: the next update's
            # bias correction would be step 2's, another training (caught by tests/integration/test_init_from.py).
            set_model_state_dict(self.model, model_state, options=options)
            return
        # One param group over every parameter in the single model's order (setup's optimizer),
        # named by fully qualified names as set_state_dict expects.
        (group,) = self.optimizer.param_groups
        names = [n for n in model_state if n in optim_state]
        hyper = {k: v for k, v in group.items() if k != "params"}
        optim = {"state": {n: dict(optim_state[n]) for n in names}, "param_groups": [{**hyper, "params": names}]}
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim, options=options
        )

    def full_parameters(self) -> list[torch.Tensor]:
        return self.strategy._gather_parameters()


class FSDPMemory(Memory):
    """The real storages: the local shards (FSDP2's DTensors, FSDP1's FlatParameter shards), the
    gathered parameter buffers alive at the end of forward, the sharded gradients, Adam's state."""

    def after_backward(self) -> dict[str, int]:
        """Parameters (the shard, plus the gathered copies alive at the end of forward) and the
        sharded gradients, which the optimizer step's zero_grad frees."""
        grads = storage_bytes(self.strategy._grad_storages())
        shard = storage_bytes(self.strategy._shard_storages())
        peak = max(self.strategy._peak_param_bytes, storage_bytes(self.strategy._param_storages()))
        if self.opts.sharding == "grad_op":
            # The shard is what the optimizer updates (ZeRO's "master" copy); the gathered working
            # copy is what forward/backward use. Both are alive between forward and backward.
            return {"param_bytes": peak - shard, "master_param_bytes": shard, "grad_bytes": grads}
        return {"param_bytes": peak, "master_param_bytes": 0, "grad_bytes": grads}

    def after_step(self) -> dict[str, int]:
        """The optimizer's per-parameter state of this rank's shards, created by the first step
        (Adam's scalar step counters are left out)."""
        state = self.optimizer.state.values()
        return {
            "optim_bytes": storage_bytes(
                v for per_param in state for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0
            )
        }

    def analytic(self, num_params: int) -> dict[str, int]:
        """ZeRO paper per-rank model states in fp32 (4 bytes/param weights, 4 grads, Adam 8),
        with N = world size (hybrid: the shard group's size): full and hybrid = ZeRO-3 (everything
        /N); grad_op = ZeRO-2 (working parameters replicated, 4 bytes/param, during forward/backward;
        the fp32 shard the optimizer updates, 4/N, is the paper's master copy; grads and optimizer
        state /N); no_shard = DDP."""
        n = shard_size(self.cfg)
        k = optimizer_bytes_per_param(self.cfg.trainer)
        # bf16 (MixedPrecisionPolicy): the working copy is gathered in bf16 (2 bytes/param); the
        # shards, gradients (reduce_dtype fp32) and Adam state stay fp32.
        w = 2 if self.opts.mixed_precision == "bf16" else 4
        per = {  # bytes per parameter: (working params, master shard, grads, optimizer state)
            "full": (4 / n, 0, 4 / n, k / n),
            "hybrid": (4 / n, 0, 4 / n, k / n),
            "grad_op": (w, 4 / n, 4 / n, k / n),
            "no_shard": (4, 0, 4, k),
        }[self.opts.sharding]
        keys = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")
        return {key: int(b * num_params) for key, b in zip(keys, per)}


@register("fsdp")
class FSDPStrategy(Strategy, metaclass=abc.ABCMeta):
    """What FSDP1 and FSDP2 share; ``FSDPStrategy(cfg, env)`` builds the one strategy.version names."""

    plan = FSDPPlan
    State = FSDPState
    Memory = FSDPMemory
    replica_dims = (REPLICATE,)  # under strategy.cp fully_shard shards over shard x cp: cp ranks differ

    api_version: ClassVar[int | None] = None  # strategy.version a subclass implements
    _by_version: ClassVar[dict[int, type]] = {}  # filled as v1.py and v2.py define their class

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # Only the class that names a version implements it: a subclass of FSDP2 (a test's broken
        # variant, a plugin) must not replace FSDP2 for every later run.
        if "api_version" in cls.__dict__:
            FSDPStrategy._by_version[cls.api_version] = cls

    def __new__(cls, cfg: DictConfig, env) -> FSDPStrategy:
        if cls is FSDPStrategy:  # the registry knows one name; the version picks the class
            cls = FSDPStrategy._by_version[cfg.strategy.version]
        return super().__new__(cls)

    def __init__(self, cfg: DictConfig, env) -> None:
        super().__init__(cfg, env)
        self._peak_param_bytes = 0

    # ----- what each torch API does its own way -----
    @abc.abstractmethod
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard model (every unit, then the root) with this API."""

    @abc.abstractmethod
    def _gather_parameters(self) -> list[torch.Tensor]:
        """Every full parameter, gathered from the shards (collective)."""

    @abc.abstractmethod
    def _param_storages(self) -> list[torch.Tensor | None]:
        """Parameter storages alive now: the persistent shards and any gathered (unsharded) copies."""

    @abc.abstractmethod
    def _shard_storages(self) -> list[torch.Tensor]:
        """The persistent parameter shards only (what the optimizer updates)."""

    def _grad_storages(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.model.parameters()]

    def _before_state_dict(self) -> None:
        """Bring the module into the state get_state_dict expects (FSDP2: resharded)."""

    # ----- setup and training -----
    experts: ExpertParallel | None = None  # strategy.ep > 1: this rank's experts, held whole

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)
        self.experts = expert_parallel(self, model)  # before _wrap: fully_shard leaves them alone
        self.model = self._wrap(model)
        self.optimizer = make_optimizer(self.model.parameters())

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # In bf16 the model's output is bf16: the loss is taken in fp32, as every other bf16 row
        # takes it (a bf16 cross-entropy alone moved the loss by 1.1e-2 at step 0, docs/parity.md).
        return self.loss_fn(self.model(inputs).float(), targets)

    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        loss = self.forward_loss(inputs, targets)
        if micro == num_micro - 1:
            # End of forward: grad_op still holds every gathered unit here, its peak of parameters.
            self._peak_param_bytes = storage_bytes(self._param_storages())
        (loss / num_micro).backward()
        if self.experts is not None and micro == num_micro - 1:
            self.experts.reduce_gradients()  # FSDP reduced the dense ones in backward
        return loss.detach()

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """With strategy.tp > 1 the tp ranks of a data-parallel rank share one loss: the world's
        mean is the mean over the data-parallel ranks."""
        if self.opts.tp == 1:
            return super().global_mean_loss(local_mean)
        local_mean = local_mean.detach().clone()
        dist.all_reduce(local_mean)
        return float(local_mean / self.env.world_size)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)  # collective (all-gathers): every rank runs the same batches

    def extra_metrics(self) -> dict:
        extras = {"fsdp_version": self.opts.version, "sharding": self.opts.sharding}
        return extras if self.experts is None else {**extras, **self.experts.metrics()}

    def run_comm_theory_psi(self, num_params: int) -> float | None:
        """Under ep: fully_shard's padded gathers and reduce-scatter of the dense parameters over the
        shard group, HSDP's all-reduce of their gradient shard over the replicas, the experts'
        all-reduce over their replicas (fsdp/predict.py ``fsdp_ep_comm``) and the exchanges the
        step's routing implies (strategies/ep/dispatch.py), in Ψ of the whole model."""
        if self.experts is None:
            return super().run_comm_theory_psi(num_params)
        if self.opts.tp > 1:
            return self._tp_ep_theory_psi(num_params)
        from parallel_lab.strategies.fsdp.predict import fsdp_ep_comm, sharded_params

        experts = sum(p.numel() for p in self.experts.expert_parameters())
        dense = fsdp_ep_comm(sharded_params(self.model), experts, self.layout, self.env.rank, self.cfg)
        routed = sum(self.experts.theory_bytes_per_step().values())
        return (sum(dense.values()) + routed) / (4 * num_params)

    def _tp_ep_theory_psi(self, num_params: int) -> float:
        """FSDP2 x TP x EP: the planner's bytes of this rank (fsdp/predict.py, on the meta model:
        the gathers and reduce-scatter of the tp-local shards, Megatron's all-reduces) with the
        exchanges the step's routing implied in place of its equal-load estimate, in Ψ."""
        from parallel_lab.models import build_meta_model
        from parallel_lab.strategies.ep.rules import balanced_comm
        from parallel_lab.strategies.fsdp.predict import predict_fsdp2_comm

        meta = build_meta_model(self.cfg.model)
        planned = sum(predict_fsdp2_comm(self.cfg, meta, self.env.rank).values())
        micro = self.cfg.trainer.global_batch // (self.layout.data_parallel_size * self.cfg.trainer.grad_accum)
        balanced = sum(balanced_comm(self.cfg, meta, micro).values())
        routed = sum(self.experts.theory_bytes_per_step().values())
        return (planned - balanced + routed) / (4 * num_params)
