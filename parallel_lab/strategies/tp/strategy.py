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
- vit: Megatron's split of every block (q/k/v and fc1 column, proj and fc2 row; 2 all-reduces per
  block each way), optionally with sequence parallelism (``strategy.sequence_parallel``):
  ``tp/megatron.py``, ``tp/megatron_dtensor.py``, entry point ``tp/split.py``, docs/tp.md.
- gpt (manual): the same split of every block (GQA: kv heads / tp; swiglu's gate as fc1), and the
  vocabulary split at both ends: the embedding's rows, the head's projection (tied: the same
  rows), the vocab-parallel cross-entropy as the loss and gathered logits for evaluation
  (``tp/vocab.py``).

``strategy.impl=dtensor`` does the same split with torch.distributed.tensor.parallel
(``ColwiseParallel``/``RowwiseParallel`` on a 1-D DeviceMesh), where DTensor inserts the same two
collectives.

dp x tp: ``strategy.replicate=R`` copies of the tp group on a (replicate, tp) mesh
(``strategies/mesh.py``), R x tp = world_size. Each tp group (consecutive ranks) reads its own
global_batch / R samples; f and g run on the tp sub-group, and after backward every rank averages
its (sharded or replicated) gradients with the same part in the other replicas.

gpt x cp x tp (``strategy.cp``, tp/cp_rules.py): a (replicate, cp, tp) mesh; after the split the
gpt's tokens are sharded over the cp ranks of each tp coordinate (strategies/cp: the causal,
load-balanced ring or Ulysses on the tp rank's heads), each rank's vocab-parallel loss over its own
tokens' labels, and the gradients averaged over the cp group before the replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.batchnorm import ReplicaNorm
from parallel_lab.strategies.clip import clip_by_global_norm
from parallel_lab.strategies.cp.strategy import ContextParallel
from parallel_lab.strategies.ep.parallel import ExpertParallel, expert_parallel
from parallel_lab.strategies.memory import HeldMemory, analytic_state_bytes, local_tensor, tensor_bytes
from parallel_lab.strategies.mesh import REPLICATE, Mesh, average_gradients
from parallel_lab.strategies.precision import Bf16Compute
from parallel_lab.strategies.rank_shards import RankShardState
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.tp.comm import gather_shards
from parallel_lab.strategies.tp.layers import ColumnParallel, RowParallel, replace_module
from parallel_lab.strategies.tp.megatron import TPGroup, sequence_parallel_params
from parallel_lab.strategies.tp.rules import TPPlan, split_plan
from parallel_lab.strategies.tp.split import split_transformer
from parallel_lab.strategies.tp.vocab import VocabParallelLoss, gather_vocab, split_gpt, vocab_layers

IMPLS: dict[str, type] = {}  # strategy.impl -> the subclass that runs it (filled by tp/ds_autotp.py)


class TPState(RankShardState):
    """One file per rank; the split layers' shards gathered along their split dimension."""

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The split layers' chunk of this tp rank, as setup cut it (tp/layers.py ``_shard``)."""
        if name not in self.strategy.shard_dims:
            return full
        return full.chunk(self.opts.tp, self.strategy.shard_dims[name])[self.strategy.tp_rank].contiguous()

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter in the single model's order and shape: shards are all-gathered and
        concatenated along their split dimension; under ep each MoE layer's experts gathered from
        the ep group (strategies/ep/parallel.py)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        if self.strategy.experts is not None:
            return self.strategy.experts.full_parameters(self.model, lambda p: self._whole(names[id(p)], p))
        return [self._whole(name, p) for name, p in self.model.named_parameters()]

    def _whole(self, name: str, p: torch.Tensor) -> torch.Tensor:
        local = local_tensor(p.detach()).contiguous()
        if name in self.strategy.shard_dims:
            local = gather_shards(local, self.strategy.shard_dims[name], self.strategy.group, self.opts.tp)
        return local


class TPMemory(HeldMemory):  # the split layers count their shard
    def analytic(self, num_params: int) -> dict[str, int]:
        """Textbook: the split layers' weights divided by tp, everything else whole."""
        return analytic_state_bytes(self.strategy.analytic_numel, self.cfg.trainer)


@register("tp")
class TensorParallelStrategy(ContextParallel, Bf16Compute, Strategy):
    plan = TPPlan
    State = TPState
    Memory = TPMemory
    Norm = ReplicaNorm
    experts: ExpertParallel | None = None  # strategy.ep > 1: this rank's share of the experts
    vocab_tp: TPGroup | None = None  # model=gpt: the tp ranks its vocabulary is split over

    def __new__(cls, cfg: DictConfig, env):
        """strategy.impl's own subclass where it has one (IMPLS: deepspeed, tp/ds_autotp.py)."""
        return super().__new__(IMPLS.get(cfg.strategy.impl, cls) if cls is TensorParallelStrategy else cls)

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)
        self.mesh = Mesh(self.layout, self.device.type, self.comm)  # collective
        self.group = self.mesh.group("tp")  # this rank's tp sub-group (None: the world)
        self.replicate_group = self.mesh.group(REPLICATE)  # None: one replica
        self.tp_rank = self.layout.coords(self.env.rank)["tp"]
        self.experts = expert_parallel(self, model)  # strategy.ep: this rank's experts, the MoE MLPs whole
        plan = split_plan(self.cfg.model.name, self.opts.split_conv, model)
        self.split_kinds = {**{c: "column" for c, _ in plan if c}, **{r: "row" for _, r in plan}}
        if self.cfg.model.name == "gpt":  # the vocabulary's rows: the embedding's, the untied head's
            self.split_kinds.update({name: "column" for name in vocab_layers(model)})
        self.analytic_numel = self._numel_per_rank(model)
        self.sp_params: list[nn.Parameter] = []  # manual SP: gradients of a slice of the tokens, summed
        if self.cfg.model.name == "gpt":
            self.shard_dims = self._split_gpt(model)
        elif self.cfg.model.name == "vit":
            self.shard_dims = self._split_vit(model)
        elif self.opts.impl == "manual":
            self.shard_dims = self._split_manual(model, plan)
        else:
            self.shard_dims = self._split_dtensor(model, plan)
        self.parallelize_context(model)  # strategy.cp (the gpt): its tokens over the cp ranks, after the split
        self.model = model
        self.optimizer = make_optimizer(self.model.parameters())

    def _numel_per_rank(self, model: nn.Module) -> int:
        """Textbook count before splitting: split weights (and column biases) divided by tp,
        everything else (replicated layers, row-parallel biases) whole."""
        split = 0
        for name, kind in self.split_kinds.items():
            layer = model.get_submodule(name)
            split += layer.weight.numel()
            if kind == "column" and getattr(layer, "bias", None) is not None:
                split += layer.bias.numel()
        return sum(p.numel() for p in model.parameters()) - split + split // self.opts.tp

    def _split_vit(self, model: nn.Module) -> dict[str, int]:
        """Megatron's split of every block (tp/megatron.py), with the tp group or its 1-D mesh."""
        sp = self.opts.sequence_parallel
        if self.opts.impl == "manual":
            shard_dims = split_transformer(model, TPGroup(self.group, self.tp_rank, self.opts.tp), sp)
            params = dict(model.named_parameters())
            self.sp_params = [params[n] for n in sequence_parallel_params(model)] if sp else []
            return shard_dims
        return split_transformer(model, self._tp_mesh(), sp)

    def _split_gpt(self, model: nn.Module) -> dict[str, int]:
        """Megatron's split of the gpt with its vocab-parallel ends (tp/vocab.py); the loss is then
        the vocab-parallel cross-entropy of this rank's logit columns."""
        tp = TPGroup(self.group, self.tp_rank, self.opts.tp)
        self.vocab_tp = tp
        self.loss_fn = VocabParallelLoss(tp)
        shard_dims = split_gpt(model, tp, self.opts.sequence_parallel)
        params = dict(model.named_parameters())
        self.sp_params = [params[n] for n in sequence_parallel_params(model)] if self.opts.sequence_parallel else []
        return shard_dims

    def _tp_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        self.tp_mesh = self.mesh.sub_mesh("tp")
        if self.tp_mesh is None:  # a flat layout: the tp group is the world
            self.tp_mesh = init_device_mesh(self.device.type, (self.opts.tp,), mesh_dim_names=("tp",))
        return self.tp_mesh

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
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self._tp_mesh()
        layer_plan = {}
        for column, row in plan:
            if column is not None:
                layer_plan[column] = ColwiseParallel()
                layer_plan[row] = RowwiseParallel()
            else:
                layer_plan[row] = RowwiseParallel(input_layouts=Replicate())
        parallelize_module(model, self.tp_mesh, layer_plan)
        return {
            name: p.placements[0].dim
            for name, p in model.named_parameters()
            if hasattr(p, "placements") and isinstance(p.placements[0], Shard)
        }

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The gpt's logits are this rank's vocabulary columns: all of them gathered for the argmax."""
        logits = super().predict(inputs)
        return logits if self.vocab_tp is None else gather_vocab(logits, self.vocab_tp)

    # ----- training -----
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, micro: int, num_micro: int) -> torch.Tensor:
        """dtensor: DTensor's functional collectives are recorded in the counter while the step runs."""
        if self.opts.impl != "dtensor":
            return super().train_step(inputs, targets, micro, num_micro)
        from parallel_lab.strategies.tp.megatron_dtensor import CountFunctional

        with CountFunctional(self.comm, self.group):
            return super().train_step(inputs, targets, micro, num_micro)

    def sum_sequence_parallel_grads(self) -> None:
        """SP: the LayerNorms (and, manual, the row biases) saw this rank's tokens only; their whole
        gradient is the sum over the tp ranks. Manual: one all-reduce of them all, flattened;
        dtensor: DTensor leaves them Partial, each is redistributed to Replicate (before clipping
        reads them; Adam would otherwise all-reduce them at every use)."""
        if self.opts.impl == "dtensor":
            from torch.distributed.tensor import Partial

            from parallel_lab.strategies.tp.megatron_dtensor import CountFunctional

            with CountFunctional(self.comm, self.group):
                for p in self.model.parameters():
                    if p.grad is not None and any(isinstance(x, Partial) for x in getattr(p.grad, "placements", ())):
                        p.grad = p.grad.redistribute(placements=p.placements)
            return
        grads = [p.grad for p in self.sp_params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """A tp group shares one loss: the mean over the replicas' losses (with cp, over every rank:
        each cp rank's loss is its tokens', ContextParallel's)."""
        if self.layout.cp > 1:
            return super().global_mean_loss(local_mean)
        if self.replicate_group is not None:
            local_mean = local_mean.detach().clone()
            dist.all_reduce(local_mean, group=self.replicate_group)
            local_mean /= self.opts.replicate
        return float(local_mean)

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each replica scored its own shard; the ranks of a tp group scored the same one, and so did
        its cp ranks (each predicted every token, gathered: ContextParallel.predict)."""
        if self.replicate_group is not None:
            dist.all_reduce(counts, group=self.replicate_group)
        return counts

    def average_over_replicas(self) -> None:
        """Data parallelism: every replica saw its own global_batch / replicate samples; under ep
        the experts' gradients are summed over their own replicas (strategies/ep/parallel.py). With
        cp each cp rank's gradient is of its own tokens' mean loss: averaged over the cp group first
        (the mean of the cp ranks' equal shares is the replica's mean over all its tokens)."""
        if self.layout.cp > 1:  # the parent refuses ep with cp (tp/cp_rules.py)
            average_gradients(self.model.parameters(), self.cp_group.group, self.layout.cp)
        if self.experts is None:
            return average_gradients(self.model.parameters(), self.replicate_group, self.opts.replicate)
        experts = {id(p) for p in self.experts.expert_parameters()}
        dense = [p for p in self.model.parameters() if id(p) not in experts]
        average_gradients(dense, self.replicate_group, self.opts.replicate)
        self.experts.reduce_gradients()

    def optimizer_step(self) -> None:
        self.sum_sequence_parallel_grads()
        self.average_over_replicas()
        super().optimizer_step()

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

    def run_comm_theory_psi(self, num_params: int) -> float | None:
        """Under ep: Megatron's all-reduces and the replicas' gradient average as the planner counts
        them (tp/predict.py), with the exchanges the step's routing implies in place of the planner's
        equal-load estimate (strategies/ep/dispatch.py), in Ψ of the whole model."""
        if self.experts is None:
            return super().run_comm_theory_psi(num_params)
        from parallel_lab.models import build_meta_model

        routed = self.experts.theory_bytes_per_step()
        planned = self.plan.predict_comm(self.cfg, build_meta_model(self.cfg.model), self.env.rank)
        planned = {op: n for op, n in planned.items() if op not in routed}
        return (sum(planned.values()) + sum(routed.values())) / (4 * num_params)

    def extra_metrics(self) -> dict:
        return (self.experts.metrics() if self.experts is not None else {}) | {
            "tp_degree": self.opts.tp,
            "tp_impl": self.opts.impl,
            "tp_split_layers": self.split_kinds,
            "tp_shard_param_bytes": tensor_bytes(
                local_tensor(p) for n, p in self.model.named_parameters() if n in self.shard_dims
            ),
        }

    def teardown(self) -> None:
        super().teardown()
        self.tp_mesh = self.replicate_group = self.vocab_tp = None
        self.loss_fn = nn.CrossEntropyLoss()
