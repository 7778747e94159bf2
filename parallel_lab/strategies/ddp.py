"""``ddp``: torch DistributedDataParallel.

Communication: every rank holds a full replica; during backward, gradients are grouped into
buckets of ``bucket_cap_mb`` and each full bucket is all-reduced (averaged) while the rest of
backward still runs, so communication overlaps computation. Per step each rank sends and receives
about 2(N-1)/N x the gradient bytes (ring all-reduce). With gradient accumulation, ``no_sync()``
skips the all-reduce on every micro-batch but the last.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.cp.strategy import ContextParallel
from parallel_lab.strategies.ddp_rules import DDPPlan
from parallel_lab.strategies.ep.parallel import ExpertParallel, expert_parallel
from parallel_lab.strategies.ep.state import ExpertShardedState
from parallel_lab.strategies.precision import Bf16Compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import ReplicatedMemory


class DDPMemory(ReplicatedMemory):
    def after_backward(self) -> dict[str, int]:
        report = super().after_backward()
        # DDP's reducer keeps flat bucket buffers. With gradient_as_bucket_view the .grad tensors
        # are views into them (already counted); otherwise the buckets are a second gradient copy.
        if not self.opts.gradient_as_bucket_view:
            report["comm_buffer_bytes"] = report["grad_bytes"]
        return report


# torch 2.13 names the switch forward_sync_buffers (broadcast_buffers defaults to None there);
# older torch (2.11 on the GPU image docs/gpu.md used) knows only broadcast_buffers.
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


@register("ddp")
class DDPStrategy(ContextParallel, Bf16Compute, Strategy):
    plan = DDPPlan
    State = ExpertShardedState  # ReplicatedState without ep
    Memory = DDPMemory

    experts: ExpertParallel | None = None  # strategy.ep > 1: this rank's share of the experts

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        model = model.to(self.device)
        self.parallelize_context(model)  # strategy.cp > 1: the vit's tokens sharded (strategies/cp)
        self.experts = expert_parallel(self, model)
        if self.experts is not None:  # their gradients are reduced over their own replicas, not all ranks
            names = self.experts.expert_names(model)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.opts.bucket_cap_mb,
            gradient_as_bucket_view=self.opts.gradient_as_bucket_view,
            # BatchNorm's running statistics: DDP would broadcast rank 0's before every forward, from
            # C++ (uncounted), leaving each rank its own after the last step; the loop's
            # Norm.sync_running_stats copies them after every step instead (batchnorm.py, docs/batchnorm.md).
            **NO_BUFFER_SYNC,
        )
        # DDP's built-in reducer all-reduces from C++, invisible to the Python-level counter
        # (parallel_lab.comm.counter). The stock average-then-all-reduce hook does the same work
        # through torch.distributed.all_reduce, so every bucket is counted.
        self.model.register_comm_hook(None, allreduce_hook)
        self.optimizer = make_optimizer(self.model.parameters())

    def extra_metrics(self) -> dict:
        """``buckets``: the reducer's buckets after its rebuild, what ``DDPPlan.collective_calls``
        predicts (one all-reduce each per step)."""
        data = self.model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        buckets = {"buckets": len(str(sizes).split(","))}
        return buckets if self.experts is None else {**buckets, **self.experts.metrics()}

    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        # Only the last micro-batch of a step all-reduces; the others just accumulate locally.
        sync = micro == num_micro - 1
        with contextlib.nullcontext() if sync else self.model.no_sync():
            return super().train_step(inputs, targets, micro, num_micro)

    def optimizer_step(self) -> None:
        if self.experts is not None:
            self.experts.reduce_gradients()
        super().optimizer_step()

    def run_comm_theory_psi(self, num_params: int) -> float | None:
        """Under ep: the all-reduce of the dense gradients (2 x their bytes) and the exchanges the
        step's routing implies (strategies/ep/dispatch.py), in Ψ of the whole model."""
        if self.experts is None:
            return super().run_comm_theory_psi(num_params)
        experts = {id(p) for p in self.experts.expert_parameters()}
        dense = sum(p.numel() for p in self.model.parameters() if id(p) not in experts)
        routed = sum(self.experts.theory_bytes_per_step().values())
        return (2 * 4 * dense + routed) / (4 * num_params)
