"""``strategy=tp strategy.impl=deepspeed``: DeepSpeed's AutoTP training (DeepSpeed config
``tensor_parallel.autotp_size`` with a ``partition_config`` of layer patterns) on the toolkit's model.

``deepspeed.initialize`` swaps each matched ``nn.Linear`` in place for its ``LinearLayer``
(column-parallel: output features split, the input's gradient all-reduced in backward) or
``LinearAllreduce`` (row-parallel: input features split, the output all-reduced in forward, the
bias added after it), the same Megatron split as the manual impl (tp/strategy.py). The layers:
``DS_TP_SPECS`` (vit: each block's q, k, v and fc1 column, proj and fc2 row; cnn: fc1 column,
fc2 row). The engine runs at ZeRO stage 0 with the toolkit's torch optimizer as its client
optimizer; ``gradient_clipping`` is 0 and the tp strategy's own clip (the full gradient's norm,
shard norms summed over the tp ranks) runs between backward and ``engine.step()``.

Measured on CPU/gloo with DeepSpeed 0.19.8 (docs/facts.md): AutoTP training runs there; the
config's batch check counts every rank as data-parallel (``train_batch_size`` must be micro x
accumulation x world size, not x the data-parallel size), and the replaced row-parallel layer has
no ``in_features`` (the vit's attention reads it): both handled here.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel_lab.strategies.base import OptimizerFactory
from parallel_lab.strategies.mesh import REPLICATE, Mesh
from parallel_lab.strategies.tp.ds_rules import autotp_ds_config, held_numels, split_layers
from parallel_lab.strategies.tp.strategy import IMPLS, TensorParallelStrategy


class DeepSpeedTensorParallelStrategy(TensorParallelStrategy):
    """tp with ``strategy.impl=deepspeed`` (chosen by ``TensorParallelStrategy.__new__``)."""

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        from parallel_lab.strategies.zero.strategy import ZeroStrategy, import_deepspeed

        ZeroStrategy.init_distributed(self.env, self.cfg.dist_timeout_s)  # adopts the group: deepspeed.comm on it
        deepspeed = import_deepspeed()
        model = model.to(self.device)
        self.mesh = Mesh(self.layout, self.device.type, self.comm)  # collective
        self.group = self.mesh.group("tp")
        self.replicate_group = self.mesh.group(REPLICATE)
        self.tp_rank = self.layout.coords(self.env.rank)["tp"]
        self.split_kinds = split_layers(model, self.cfg.model.name)
        self.analytic_numel = sum(held_numels(model, self.split_kinds, self.opts.tp, 0))
        in_features = {n: model.get_submodule(n).in_features for n in self.split_kinds}
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model.parameters()), config=autotp_ds_config(self.cfg)
        )
        for name, full in in_features.items():  # the model reads it (vit attention); the replacement lacks it
            setattr(model.get_submodule(name), "in_features", full)
        dims = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1}}
        self.shard_dims = {
            f"{layer}.{kind}": dim for layer, split in self.split_kinds.items() for kind, dim in dims[split].items()
        }
        self.model, self.optimizer = model, self.engine.optimizer  # ZeRO stage 0: the client torch optimizer

    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        loss = self.loss_fn(self.engine(inputs), targets)
        self.engine.backward(loss)  # divides by gradient_accumulation_steps
        if micro < num_micro - 1:
            self.engine.step()  # off the boundary DeepSpeed only counts the micro-batch
        return loss.detach()

    def optimizer_step(self) -> None:
        self.clip_gradients()
        self.engine.step()

    def teardown(self) -> None:
        if getattr(self, "engine", None) is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = None
        super().teardown()


IMPLS["deepspeed"] = DeepSpeedTensorParallelStrategy
