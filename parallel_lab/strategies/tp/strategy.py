"""``tp``: toy Megatron-style tensor parallelism (Shoeybi et al., arXiv 1909.08053).

The SAME model class is built on every rank; then chosen layers are split in place:

- column-parallel (``fc1``): rank r keeps output features [r*k, (r+1)*k) of the weight and bias, so
  it computes a slice of the layer's output. The activation between the two layers (ReLU) is
  element-wise, so it runs on the slice with no communication.
- row-parallel (``fc2``): rank r keeps the matching input columns of the weight, so it turns its
  slice into a *partial sum* of the full output. One all-reduce completes the sum; the (small,
  replicated) bias is added after it.

Communication per forward is one all-reduce of the row-parallel output (batch x 10 floats for the
cnn) and per backward one all-reduce of the column-parallel input's gradient (batch x 1024), the
conjugate collectives ``f``/``g`` of ``parallel_lab.strategies.tp.comm``. Everything outside the split
layers is replicated and gets identical gradients on every rank, because every tp rank sees the
whole global batch and f's backward makes the gradient flowing into the shared layers identical.

What is split, per model (``TP_PLANS``):
- cnn: fc1 (1024->256) column, fc2 (256->10) row; with ``strategy.split_conv=true`` also block1's
  conv output channels (column, 3->32) and block2's conv input channels (row, 32->64).
- resnet18: only the head ``fc`` (512->10), row-parallel on its 512 input features, fed by the
  replicated pooled features (each rank slices them; f sums the slices' gradients back). 97% of
  ResNet-18's weights are convolutions and stay replicated: this is a toy split of the head.

``strategy.impl=dtensor`` does the same split with torch.distributed.tensor.parallel
(``ColwiseParallel``/``RowwiseParallel`` on a 1-D DeviceMesh), where DTensor inserts the same two
collectives.

dp x tp: ``strategy.replicate=R`` copies of the tp group on a (replicate, tp) mesh
(``strategies/mesh.py``), R x tp = world_size. Each tp group (consecutive ranks) reads its own
global_batch / R samples; f and g run on the tp sub-group, and after backward every rank averages
its (sharded or replicated) gradients with the same part in the other replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from parallel_lab.choices import Choice
from parallel_lab.errors import ConfigError
from parallel_lab.strategies import register
from parallel_lab.strategies.base import ComputeShape, OptimizerFactory, Strategy, StrategyOptions
from parallel_lab.strategies.clip import clip_by_global_norm
from parallel_lab.strategies.memory import (
    analytic_state_bytes,
    held_optimizer_bytes,
    held_param_grad_bytes,
    local_tensor,
    tensor_bytes,
)
from parallel_lab.strategies.mesh import DataParallelReplicas, check_degrees
from parallel_lab.strategies.rank_shards import RankShardCheckpoint
from parallel_lab.strategies.tp.layers import ColumnParallel, RowParallel, replace_module


class TensorImpl(Choice):
    """strategy.impl of tp: whose layers split the weights."""

    manual = "manual"
    dtensor = "dtensor"


# (column-parallel layer, row-parallel layer) pairs; None = the row layer's input is replicated.
TP_PLANS: dict[str, list[tuple[str | None, str]]] = {
    "cnn": [("fc1", "fc2")],
    "resnet18": [(None, "fc")],
}
CONV_PLANS: dict[str, list[tuple[str | None, str]]] = {
    "cnn": [("block1.0", "block2.0")],
}


@dataclass
class TPOptions(StrategyOptions):
    """``strategy=tp`` options."""

    tp: int = 2  # tensor-parallel degree: must divide every split width; replicate x tp = world_size
    replicate: int = 1  # data-parallel copies of the tp group (dp x tp on a 2-D mesh); 1 = tp only
    # manual (our f/g autograd.Functions) | dtensor (torch.distributed.tensor.parallel)
    impl: TensorImpl = TensorImpl.manual
    split_conv: bool = False  # cnn + manual only: also split block1's conv output / block2's input channels


def split_plan(model_name: str, split_conv: bool) -> list[tuple[str | None, str]]:
    return (CONV_PLANS.get(model_name, []) if split_conv else []) + TP_PLANS[model_name]


@register("tp")
class TensorParallelStrategy(DataParallelReplicas, RankShardCheckpoint, Strategy):
    Options = TPOptions
    degree_key = "tp"

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """A tp rank runs its replica's whole batch through the model, the split layers' FLOPs / tp."""
        from parallel_lab.strategies.tp.predict import tp_share

        split = [layer for pair in split_plan(cfg.model.name, cfg.strategy.split_conv) for layer in pair if layer]
        share = tp_share(model, split, cfg.strategy.tp)
        shape = super().compute_shape(cfg, model)
        return ComputeShape(
            shape.micro_batch, shape.slots, share, note=f"tp rank does {share:.2f} of the FLOPs on the whole batch"
        )

    # ----- validation (parent) -----
    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.tp < 1:
            raise ConfigError(f"strategy.tp={opts.tp} must be >= 1; use strategy.tp=2")
        model_name = cfg.model.name
        if model_name not in TP_PLANS:
            raise ConfigError(
                f"strategy=tp has no split plan for model={model_name}; use model={' or model='.join(TP_PLANS)}"
            )
        if opts.split_conv and model_name not in CONV_PLANS:
            raise ConfigError(
                f"strategy.split_conv=true is only defined for model={', '.join(CONV_PLANS)}; "
                f"set strategy.split_conv=false"
            )
        if opts.split_conv and opts.impl != "manual":
            raise ConfigError(
                "strategy.split_conv=true needs strategy.impl=manual "
                "(ColwiseParallel/RowwiseParallel split nn.Linear only)"
            )
        for name, width, what in cls._split_widths(cfg, opts):
            if width % opts.tp:
                raise ConfigError(
                    f"strategy.tp={opts.tp} does not divide the {width} {what} of {name}; "
                    f"use a strategy.tp that divides {width} (e.g. strategy.tp=2)"
                )
        check_degrees(cfg, opts.replicate, "tp", opts.tp, "tensor-parallel degree")

    @classmethod
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """Every tp rank runs the whole batch through the replicated BatchNorm layers, so plain
        BatchNorm already matches single; syncing over strategy.replicate copies is not built here.
        A BatchNorm after block1's split conv would see a slice of its channels."""
        from parallel_lab.models import norm_of

        norm = norm_of(cfg.model)
        if norm == "syncbatch":
            return (
                "model.norm=syncbatch: strategy=tp ranks all normalise the same whole batch (model.norm=batch "
                "already matches single); SyncBatchNorm over strategy.replicate is not built, use model.norm=batch"
            )
        if norm == "batch" and cfg.strategy.get("split_conv"):
            return (
                "model.norm=batch with strategy.split_conv=true: block1's BatchNorm would see a slice of its "
                "channels; set strategy.split_conv=false"
            )
        return None

    @classmethod
    def _split_widths(cls, cfg: DictConfig, opts: DictConfig) -> list[tuple[str, int, str]]:
        """(layer, width, which width) for every dimension the plan splits; built on the meta
        device, so no memory is used and no weights are initialised."""
        from parallel_lab.models import build_meta_model

        model = build_meta_model(cfg.model)
        widths = []
        for column, row in split_plan(cfg.model.name, opts.split_conv):
            if column is not None:
                widths.append((column, model.get_submodule(column).weight.shape[0], "output features/channels"))
            widths.append((row, model.get_submodule(row).weight.shape[1], "input features/channels"))
        return widths

    # ----- data placement: every tp rank sees the whole batch -----
    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        return cfg.world_size // cfg.strategy.tp

    @property
    def dp_rank(self) -> int:
        return self.env.rank // self.opts.tp  # tp groups are runs of consecutive ranks

    @property
    def dp_size(self) -> int:
        return self.env.world_size // self.opts.tp

    # ----- setup -----
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)
        self.group = self.build_replicas(self.opts.tp, "tp")  # this rank's tp sub-group (None: the world)
        self.tp_rank = self.env.rank % self.opts.tp
        plan = split_plan(self.cfg.model.name, self.opts.split_conv)
        self.split_kinds = {**{c: "column" for c, _ in plan if c}, **{r: "row" for _, r in plan}}
        self.analytic_numel = self._numel_per_rank(model)
        if self.opts.impl == "manual":
            self.shard_dims = self._split_manual(model, plan)
        else:
            self.shard_dims = self._split_dtensor(model, plan)
        self.model = model
        self.optimizer = make_optimizer(self.model.parameters())

    def _numel_per_rank(self, model: nn.Module) -> int:
        """Textbook count before splitting: split weights (and column biases) divided by tp,
        everything else (replicated layers, row-parallel biases) whole."""
        split = 0
        for name, kind in self.split_kinds.items():
            layer = model.get_submodule(name)
            split += layer.weight.numel()
            if kind == "column" and layer.bias is not None:
                split += layer.bias.numel()
        return sum(p.numel() for p in model.parameters()) - split + split // self.opts.tp

    def _split_manual(self, model: nn.Module, plan) -> dict[str, int]:
        """Swap each planned layer for its parallel version; return {param name: split dim}."""
        shard_dims = {}
        rank, size = self.tp_rank, self.opts.tp
        for column, row in plan:
            if column is not None:
                replace_module(model, column, ColumnParallel(model.get_submodule(column), self.group, rank, size))
                shard_dims.update({f"{column}.weight": 0, f"{column}.bias": 0})
            replace_module(
                model, row, RowParallel(model.get_submodule(row), self.group, rank, size, column is not None)
            )
            shard_dims[f"{row}.weight"] = 1
        return {n: d for n, d in shard_dims.items() if n in dict(model.named_parameters())}

    def _split_dtensor(self, model: nn.Module, plan) -> dict[str, int]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.mesh2d is not None:
            self.mesh = self.mesh2d["tp"]
        else:
            self.mesh = init_device_mesh(self.device.type, (self.opts.tp,), mesh_dim_names=("tp",))
        layer_plan = {}
        for column, row in plan:
            if column is not None:
                layer_plan[column] = ColwiseParallel()
                layer_plan[row] = RowwiseParallel()
            else:
                layer_plan[row] = RowwiseParallel(input_layouts=Replicate())
        parallelize_module(model, self.mesh, layer_plan)
        return {
            name: p.placements[0].dim
            for name, p in model.named_parameters()
            if hasattr(p, "placements") and isinstance(p.placements[0], Shard)
        }

    # ----- training -----
    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """A tp group shares one loss: the mean over the replicas' losses."""
        if self.replicate_group is not None:
            local_mean = local_mean.detach().clone()
            dist.all_reduce(local_mean, group=self.replicate_group)
            local_mean /= self.opts.replicate
        return float(local_mean)

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each replica scored its own shard; the ranks of a tp group scored the same one."""
        if self.replicate_group is not None:
            dist.all_reduce(counts, group=self.replicate_group)
        return counts

    def clip_gradients(self) -> None:
        """Clip by the norm of the FULL gradient: shard norms are summed over the tp ranks,
        replicated parameters (identical on every rank) are counted once."""
        if self.cfg.trainer.grad_clip <= 0:
            return
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        clip_by_global_norm(
            [g for n, g in named if n in self.shard_dims],
            [g for n, g in named if n not in self.shard_dims],
            self.cfg.trainer.grad_clip,
            self.device,
            self.group,
        )

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The split layers' chunk of this tp rank, as setup cut it (tp/layers.py ``_shard``)."""
        if name not in self.shard_dims:
            return full
        return full.chunk(self.opts.tp, self.shard_dims[name])[self.tp_rank].contiguous()

    # ----- proof -----
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter in the single model's order and shape: shards are all-gathered and
        concatenated along their split dimension."""
        full = []
        for name, p in self.model.named_parameters():
            local = local_tensor(p.detach()).contiguous()
            if name in self.shard_dims:
                parts = [torch.empty_like(local) for _ in range(self.opts.tp)]
                dist.all_gather(parts, local, group=self.group)
                local = torch.cat(parts, dim=self.shard_dims[name])
            full.append(local)
        return full

    def memory_after_backward(self) -> dict[str, int]:
        return held_param_grad_bytes(self.model)  # the split layers count their shard

    def memory_after_step(self) -> dict[str, int]:
        return held_optimizer_bytes(self.optimizer)

    def analytic_memory(self, num_params: int) -> dict[str, int]:
        """Textbook: the split layers' weights divided by tp, everything else whole."""
        return analytic_state_bytes(self.analytic_numel, self.cfg.trainer)

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
        """This rank's slices of the split layers plus everything replicated (``predict.py``)."""
        from parallel_lab.strategies.tp.predict import predict_tp_memory

        return predict_tp_memory(cfg, model, split_plan(cfg.model.name, cfg.strategy.split_conv), rank)

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        from parallel_lab.strategies.tp.predict import predict_tp_comm

        return predict_tp_comm(cfg, model, split_plan(cfg.model.name, cfg.strategy.split_conv))

    def extra_metrics(self) -> dict:
        return {
            "tp_degree": self.opts.tp,
            "tp_impl": self.opts.impl,
            "tp_split_layers": self.split_kinds,
            "tp_shard_param_bytes": tensor_bytes(
                local_tensor(p) for n, p in self.model.named_parameters() if n in self.shard_dims
            ),
        }

    def teardown(self) -> None:
        super().teardown()
        self.mesh = None
