"""``dp``: ``torch.nn.DataParallel``, one process driving every visible GPU.

Communication (inside one process, every step): the batch is scattered over the GPUs, the model
is re-replicated from GPU 0 to the others (broadcast of all weights), each replica runs forward,
outputs are gathered to GPU 0, and in backward the replicas' gradients are summed onto GPU 0.
GPU 0 is the hub (a star pattern), which is why DistributedDataParallel replaced it.
On a CPU-only machine DataParallel just runs the wrapped module: one replica, reported as
``replicas: 1`` in metrics.json.
"""

from __future__ import annotations

import torch

from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import ReplicatedMemory, ReplicatedState
from parallel_lab.strategies.replicated_rules import DPPlan


@register("dp")
class DataParallelStrategy(Strategy):
    plan = DPPlan  # one process: replicas (GPUs) exchange through device copies, no collectives
    State = ReplicatedState
    Memory = ReplicatedMemory

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)  # DataParallel wants the module on device_ids[0] (cuda:0)
        if self.device.type == "cuda":
            self.model = torch.nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())))
        elif torch.cuda.is_available():
            self.model = model  # device=cpu on a GPU machine: DataParallel cannot replicate on CPU
        else:
            self.model = torch.nn.DataParallel(model)  # CPU-only: a pass-through around the module
        self.replicas = len(getattr(self.model, "device_ids", [])) or 1
        self.optimizer = make_optimizer(self.model.parameters())

    def extra_metrics(self) -> dict:
        return {"replicas": self.replicas}
