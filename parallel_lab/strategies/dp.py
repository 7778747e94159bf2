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
from omegaconf import DictConfig

from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.batchnorm import Norm
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import OneProcessPlan, ReplicatedMemory, ReplicatedState


class DPNorm(Norm):
    @classmethod
    def refusal(cls, cfg: DictConfig, single_process: bool) -> str | None:
        """DataParallel's replicas are threads of one process: no process group to synchronise
        over (torch's SyncBatchNorm works with DDP only)."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch":
            return None
        return (
            "model.norm=syncbatch: strategy=dp runs its replicas in one process, where SyncBatchNorm has no "
            "process group (torch supports it with DDP only); use strategy=ddp, or model.norm=batch"
        )


@register("dp")
class DataParallelStrategy(Strategy):
    plan = OneProcessPlan  # one process: replicas (GPUs) exchange through device copies, no collectives
    State = ReplicatedState
    Memory = ReplicatedMemory
    Norm = DPNorm

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
