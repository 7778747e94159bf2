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
each unit's gathered parameters right after using them. Hybrid sharding (HYBRID_SHARD: shard
within a node, replicate across nodes) is refused: on one node without a 2-D mesh it silently
diverges (../shared/FACTS.md).

``strategy.mixed_precision=bf16`` computes forward/backward in bf16 (parameters all-gathered in
bf16, gradients reduced in fp32) while the sharded parameters and Adam states stay fp32.

Memory accounting (``memory_report``) reads the real storages: the local shards of the DTensor
parameters (FSDP2) or the FlatParameter shards (FSDP1), the gathered parameter buffers that are
alive at the end of forward (the moment ``grad_op`` holds the most), the sharded gradients and the
optimizer's state tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.strategies import register
from parallel_lab.strategies.base import OptimizerFactory, Strategy, StrategyOptions
from parallel_lab.strategies.memory import optimizer_bytes_per_param, storage_bytes

SHARDINGS = ("full", "grad_op", "no_shard")
PRECISIONS = ("fp32", "bf16")
_FSDP1_STRATEGY = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD"}


DCP_DIR = "dcp"  # torch Distributed Checkpoint files inside one of our step_* checkpoints


@dataclass
class FSDPOptions(StrategyOptions):
    version: int = 2  # 2: fully_shard (per-parameter DTensor shards); 1: FullyShardedDataParallel wrapper
    sharding: str = "full"  # full (~ZeRO-3) | grad_op (~ZeRO-2) | no_shard (~DDP)
    mixed_precision: str = "fp32"  # fp32 | bf16


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """FSDP units: the model's top-level blocks that own parameters (the root wraps the rest)."""
    return [(name, child) for name, child in model.named_children() if any(True for _ in child.parameters())]


@register("fsdp")
class FSDPStrategy(Strategy):
    Options = FSDPOptions

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.version not in (1, 2):
            raise ConfigError(f"strategy.version={opts.version} is unknown; use strategy.version=2 (fully_shard) or 1 (FSDP1 wrapper)")
        if opts.sharding.lower() in ("hybrid", "hybrid_shard", "_hybrid_shard_zero2"):
            raise ConfigError(
                f"strategy.sharding={opts.sharding} is refused: hybrid sharding needs several nodes and "
                "silently diverges on one; use strategy.sharding=full, grad_op or no_shard"
            )
        if opts.sharding not in SHARDINGS:
            raise ConfigError(f"strategy.sharding={opts.sharding} is unknown; use one of {', '.join(SHARDINGS)} (strategy.sharding=full)")
        if opts.mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"strategy.mixed_precision={opts.mixed_precision} is unknown; use strategy.mixed_precision=fp32 or bf16"
            )

    @property
    def comm_theory_psi(self) -> float:
        # full: all-gather for forward and again for backward, reduce-scatter of grads = 3Ψ;
        # grad_op keeps the forward gather for backward (2Ψ); no_shard all-reduces grads (2Ψ).
        return 3.0 if self.opts.sharding == "full" else 2.0

    def __init__(self, cfg: DictConfig, env) -> None:
        super().__init__(cfg, env)
        self._peak_param_bytes = 0
        self._peak_working_bytes = 0
        self._mesh = None

    # ----- setup -----
    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)
        self.model = self._wrap_v2(model) if self.opts.version == 2 else self._wrap_v1(model)
        self.optimizer = make_optimizer(self.model.parameters())

    def _wrap_v2(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        n = self.env.world_size
        if self.opts.sharding == "no_shard":
            # HSDP with a shard group of 1: every parameter "shard" is the whole tensor, and the
            # gradient reduction over the replicate dimension is DDP's all-reduce.
            self._mesh = init_device_mesh(self.device.type, (n, 1), mesh_dim_names=("replicate", "shard"))
        else:
            self._mesh = init_device_mesh(self.device.type, (n,), mesh_dim_names=("shard",))
        # no_shard reshards after forward too: its "all-gather" is a local copy of the whole
        # tensor, so freeing that copy costs a memcpy and keeps memory at DDP's one replica.
        kwargs = dict(mesh=self._mesh, reshard_after_forward=self.opts.sharding != "grad_op")
        if self.opts.mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for _, unit in _units(model):
            fully_shard(unit, **kwargs)
        return fully_shard(model, **kwargs)

    def _wrap_v1(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

        kwargs = dict(
            sharding_strategy=getattr(ShardingStrategy, _FSDP1_STRATEGY[self.opts.sharding]),
            # FSDP1 assumes CUDA unless told the device (../shared/FACTS.md).
            device_id=self.device,
            # Optimizer over the original parameters (views into the flat shards), so the update
            # is the same per-tensor Adam every other strategy runs.
            use_orig_params=True,
        )
        if self.opts.mixed_precision == "bf16":
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, unit in _units(model):
            setattr(model, name, FSDP(unit, **kwargs))
        return FSDP(model, **kwargs)

    # ----- training -----
    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        loss = self.forward_loss(inputs, targets)
        if micro == num_micro - 1:
            # End of forward: grad_op still holds every gathered unit here, its peak of parameters.
            self._peak_param_bytes = self._param_bytes_now()
        (loss / num_micro).backward()
        return loss.detach()

    def clip_gradients(self) -> None:
        if self.cfg.trainer.grad_clip <= 0:
            return
        if self.opts.version == 1:
            self.model.clip_grad_norm_(self.cfg.trainer.grad_clip)  # norm over all ranks' flat shards
        else:
            # DTensor gradients: the norm is reduced over the shards inside clip_grad_norm_.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)  # collective (all-gathers): every rank runs the same batches

    def _reshard(self) -> None:
        """grad_op/no_shard leave the last forward's gathered parameters registered; go back to
        the DTensor shards (FSDP2 only)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ----- checkpoints: torch Distributed Checkpoint, each rank writing its own shards -----
    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.opts.version == 2:
            self._reshard()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def save_checkpoint(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(directory / DCP_DIR))

    def load_checkpoint(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from parallel_lab.checkpoint.dcp_reader import load_sharded

        state = self._sharded_state()  # the shapes and shards to fill in
        load_sharded(state, str(directory / DCP_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def full_parameters(self) -> list[torch.Tensor]:
        if self.opts.version == 2:
            self._reshard()
            return [p.full_tensor().detach() for p in self.model.parameters()]
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model, writeback=False):
            return [p.detach().clone() for p in self.model.parameters()]

    # ----- memory -----
    def _flat_params_v1(self) -> list:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return [m._handle.flat_param for m in FSDP.fsdp_modules(self.model) if m._handle is not None]

    def _fsdp_params_v2(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        params = []
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                params.extend(group.fsdp_params if group is not None else [])
        return params

    def _param_bytes_now(self) -> int:
        """Parameter bytes alive now: the persistent shards plus any gathered (unsharded) copies."""
        if self.opts.version == 2:
            tensors = []
            for fp in self._fsdp_params_v2():
                tensors.append(fp._sharded_param_data)
                tensors.extend(fp.all_gather_outputs)  # storage resized to 0 once resharded
            return storage_bytes(tensors)
        tensors = []
        for flat in self._flat_params_v1():
            tensors.append(getattr(flat, "_local_shard", flat))
            tensors.append(getattr(flat, "_full_param_padded", None))
        return storage_bytes(tensors)

    def _shard_bytes(self) -> int:
        if self.opts.version == 2:
            return storage_bytes(fp._sharded_param_data for fp in self._fsdp_params_v2())
        return storage_bytes(getattr(f, "_local_shard", f) for f in self._flat_params_v1())

    def memory_report(self) -> dict[str, int]:
        grads = [p.grad for p in self.model.parameters()]
        if self.opts.version == 1:
            grads += [f.grad for f in self._flat_params_v1()] + [getattr(f, "_saved_grad_shard", None) for f in self._flat_params_v1()]
        optim = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        shard = self._shard_bytes()
        peak = max(self._peak_param_bytes, self._param_bytes_now())
        report = {
            "grad_bytes": storage_bytes(grads),
            "optim_bytes": storage_bytes(optim),
        }
        if self.opts.sharding == "grad_op":
            # The shard is what the optimizer updates (ZeRO's "master" copy); the gathered working
            # copy is what forward/backward use. Both are alive between forward and backward.
            report.update(param_bytes=peak - shard, master_param_bytes=shard)
        else:
            report.update(param_bytes=peak, master_param_bytes=0)
        return report

    def analytic_memory(self, num_params: int) -> dict[str, int]:
        """ZeRO paper per-rank model states in fp32 (4 bytes/param weights, 4 grads, Adam 8),
        with N = world size: full = ZeRO-3 (everything /N); grad_op = ZeRO-2 (working parameters
        replicated, 4 bytes/param, during forward/backward; the fp32 shard the optimizer updates,
        4/N, is the paper's master copy; grads and optimizer state /N); no_shard = DDP."""
        n = self.env.world_size
        k = optimizer_bytes_per_param(self.cfg.trainer)
        per = {  # bytes per parameter: (working params, master shard, grads, optimizer state)
            "full": (4 / n, 0, 4 / n, k / n),
            "grad_op": (4, 4 / n, 4 / n, k / n),
            "no_shard": (4, 0, 4, k),
        }[self.opts.sharding]
        keys = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")
        return {key: int(b * num_params) for key, b in zip(keys, per)}

    def extra_metrics(self) -> dict:
        return {"fsdp_version": self.opts.version, "sharding": self.opts.sharding}

    def teardown(self) -> None:
        super().teardown()
        self._mesh = None
