"""ZeRO's memory accounting (``ZeroMemory``): DeepSpeed's real buffers (distinct storages, padding
included), and the ZeRO paper's per-rank value beside them (the strategy's docstring says which
buffer counts where)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from parallel_lab.optim import optimizer_bytes_per_param
from parallel_lab.strategies.memory import Memory, storage_bytes
from parallel_lab.strategies.zero.ds_config import DTYPE_BYTES


def _bucket_tensors(opt) -> list[torch.Tensor]:
    """The gradient reduction buckets DeepSpeed holds now: ``ipg_buckets[dtype].buffer`` is a list
    of tensors at stages 1-2 (empty outside backward) and one tensor at stage 3."""
    tensors = []
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
        buffer = getattr(bucket, "buffer", None)
        tensors += list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
    return [t for t in tensors if t is not None]


def analytic_zero_memory(
    stage: int, precision: str, world: int, trainer: DictConfig, num_params: int
) -> dict[str, int]:
    """ZeRO paper (arXiv 1910.02054) per rank, generalised to this precision: weights w and
    gradients g bytes/param (4 in fp32, 2 in bf16), Adam 8 (SGD+momentum 4) of optimizer
    state; stage >= 1 divides the optimizer state by N, >= 2 the gradients, 3 the weights.
    master: DeepSpeed's fp32 master partition where it is a separate copy (4/N)."""
    n = world
    w = DTYPE_BYTES[precision]
    k = optimizer_bytes_per_param(trainer)
    # DeepSpeed 0.19.8 keeps its fp32 master partition as a separate copy at stages 1-3
    # (measured, fp32 included), and an unpartitioned one for bf16 at stage 0.
    separate_master = stage >= 1 or precision != "fp32"
    return {
        "param_bytes": int(w * num_params / (n if stage >= 3 else 1)),
        "master_param_bytes": int(4 * num_params / (n if stage >= 1 else 1)) if separate_master else 0,
        "grad_bytes": int(w * num_params / (n if stage >= 2 else 1)),
        "optim_bytes": int(k * num_params / (n if stage >= 1 else 1)),
    }


class ZeroMemory(Memory):
    def __init__(self, strategy) -> None:
        super().__init__(strategy)
        self._grads_before_reduction = 0
        self._bucket_peak = 0

    @property
    def engine(self):
        return self.strategy.engine

    def watch(self, opt) -> None:
        """At setup: wrap what frees buffers before the loop could read them (stage 1's gradients,
        stages 1-2's reduction buckets)."""
        if self.opts.stage == 1 and hasattr(opt, "reduce_gradients"):
            self._measure_before_reduction(opt)
        if hasattr(opt, "_release_ipg_buffers"):
            self._measure_ipg_buckets(opt)

    def _measure_before_reduction(self, opt) -> None:
        """Wrap this optimizer instance's boundary reduction to read the gradient bytes held just
        before it (afterwards DeepSpeed keeps only this rank's partition): every parameter's whole
        gradient, plus (offload) the fp32 gradient partition that lives from init on."""
        reduce = opt.reduce_gradients

        def measured_reduce(*args, **kwargs):
            self._grads_before_reduction = storage_bytes(self._grad_tensors())
            return reduce(*args, **kwargs)

        opt.reduce_gradients = measured_reduce

    def _measure_ipg_buckets(self, opt) -> None:
        """Stages 1-2 allocate their reduction bucket(s) (``ipg_buckets[dtype].buffer``, a list:
        one buffer of reduce_bucket_size elements, two with overlap_comm) when backward starts and
        free them at its end (``_release_ipg_buffers``); read them just before they go. Stage 3
        keeps its one bucket for the whole run (read after backward)."""
        release = opt._release_ipg_buffers

        def measured_release(*args, **kwargs):
            self._bucket_peak = max(self._bucket_peak, storage_bytes(_bucket_tensors(opt)))
            return release(*args, **kwargs)

        opt._release_ipg_buffers = measured_release

    def _param_tensors(self) -> list[torch.Tensor]:
        """What holds the model's parameters: the flat bit16 buffers (stages 0-2), or the ds_tensor
        partitions plus any gathered copies still alive (stage 3)."""
        opt = self.engine.optimizer
        params = list(self.engine.module.parameters())
        if self.opts.stage == 3:
            partitions = [p.ds_tensor for p in params] + list(getattr(opt, "fp16_partitioned_groups_flat", []))
            return partitions + [p.data for p in params]
        # bit16_groups_flat: ZeRO 1-2; bf16_groups_flat: BF16_Optimizer (a ds_config with fp32 gradient accumulation)
        return (
            [p.data for p in params]
            + list(getattr(opt, "bit16_groups_flat", []))
            + list(getattr(opt, "bf16_groups_flat", []))
        )

    def _master_tensors(self) -> list[torch.Tensor]:
        """DeepSpeed's fp32 partitions the optimizer updates."""
        opt = self.engine.optimizer
        if self.opts.stage == 3:
            return list(getattr(opt, "fp32_partitioned_groups_flat", []))
        # stages 1-2: the fp32 partition; BF16_Optimizer (a user's ds_config with fp32 gradient
        # accumulation) its fp32 partition too; stage 0 in bf16/fp16: FP16_UnfusedOptimizer's fp32
        # copy of every parameter (fp32_groups, a list per group), FP16_Optimizer's flat one
        tensors = list(getattr(opt, "single_partition_of_fp32_groups", []))
        tensors += list(getattr(opt, "fp32_groups_flat_partition", [])) + list(getattr(opt, "fp32_groups_flat", []))
        for group in getattr(opt, "fp32_groups", None) or []:
            tensors += list(group) if isinstance(group, (list, tuple)) else [group]
        return tensors

    def _grad_tensors(self) -> list[torch.Tensor | None]:
        """Every gradient buffer alive now: the module's .grad, the averaged partition gradients
        (stages 1-2) or the flat gradient partition (stage 3), and the fp32 master's .grad, which
        with offload DeepSpeed allocates at init and keeps (stages 1-3: 4 bytes per partition
        element; without offload the step creates and frees it)."""
        opt = self.engine.optimizer
        averaged = getattr(opt, "averaged_gradients", None) or {}
        grads = [p.grad for p in self.engine.module.parameters()] + [m.grad for m in self._master_tensors()]
        for value in averaged.values() if isinstance(averaged, dict) else averaged:
            grads += value if isinstance(value, (list, tuple)) else [value]
        if self.opts.stage == 3:
            grads.append(getattr(opt, "grad_partitions_flat_buffer", None))
        else:
            grads.append(getattr(opt, "grads_in_partition", None))
            grads += list(getattr(opt, "fp32_groups_gradients_flat", []))  # BF16_Optimizer's fp32 accumulators
        return grads

    def after_backward(self) -> dict[str, int]:
        """Parameters and every gradient buffer alive after backward; step() frees the averaged
        gradients and (without offload) the partitions' .grad."""
        return {
            "param_bytes": storage_bytes(self._param_tensors()),
            # Stage 1 frees the gradients outside its partition right after its one reduction at
            # the end of backward; before it, every rank holds them all (the ZeRO-1 state).
            "grad_bytes": max(storage_bytes(self._grad_tensors()), self._grads_before_reduction),
            "comm_buffer_bytes": self._comm_buffer_bytes(),
        }

    def after_step(self) -> dict[str, int]:
        """The optimizer's state on this rank's partition (created by the first step) and the fp32
        master partition."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # the torch optimizer DeepSpeed steps
        states = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        params = self._param_tensors()
        # The master copy counts only where it is its own storage, not a view of the parameters.
        master_bytes = storage_bytes(params + self._master_tensors()) - storage_bytes(params)
        return {"master_param_bytes": master_bytes, "optim_bytes": storage_bytes(states)}

    def _comm_buffer_bytes(self) -> int:
        """Buffers beside the model state that hold data in transit: the gradient reduction
        bucket(s) (DeepSpeed 0.19.8 keeps them in ``ipg_buckets[dtype].buffer``; older releases had
        one ``ipg_buffer`` list) and, with offload at stages 1-2, the staging copies between device and
        host: two gradient buffers of the largest parameter (``temp_grad_buffer_for_{gpu,cpu}_offload``)
        and the 16-bit copy of the updated partition (``param_buffer_of_bit16_for_cpu_offload_groups``)."""
        opt = self.engine.optimizer
        staging = [getattr(opt, "temp_grad_buffer_for_gpu_offload", None)]
        staging += [getattr(opt, "temp_grad_buffer_for_cpu_offload", None)]
        staging += list(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or [])
        buckets = max(self._bucket_peak, storage_bytes(_bucket_tensors(opt)))
        return buckets + storage_bytes(staging)

    def analytic(self, num_params: int) -> dict[str, int]:
        return analytic_zero_memory(
            self.opts.stage, self.opts.precision, self.env.world_size, self.cfg.trainer, num_params
        )
