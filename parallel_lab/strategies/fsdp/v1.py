"""FSDP1: the ``FullyShardedDataParallel`` wrapper, one flat parameter per unit, sharded."""

from __future__ import annotations

import torch

from parallel_lab.strategies.fsdp.strategy import FSDPStrategy, fsdp_units

SHARDING_STRATEGY = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD"}


class FSDP1(FSDPStrategy):
    api_version = 1

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

        kwargs = dict(
            sharding_strategy=getattr(ShardingStrategy, SHARDING_STRATEGY[self.opts.sharding]),
            # FSDP1 assumes CUDA unless told the device (docs/facts.md).
            device_id=self.device,
            # Optimizer over the original parameters (views into the flat shards), so the update
            # is the same per-tensor Adam every other strategy runs.
            use_orig_params=True,
        )
        if self.opts.mixed_precision == "bf16":
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, unit in fsdp_units(model):
            setattr(model, name, FSDP(unit, **kwargs))
        return FSDP(model, **kwargs)

    def clip_gradients(self) -> None:
        if self.cfg.trainer.grad_clip > 0:
            self.model.clip_grad_norm_(self.cfg.trainer.grad_clip)  # norm over all ranks' flat shards

    def _gather_parameters(self) -> list[torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model, writeback=False):
            return [p.detach().clone() for p in self.model.parameters()]

    def _flat_params(self) -> list:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return [m._handle.flat_param for m in FSDP.fsdp_modules(self.model) if m._handle is not None]

    def _param_storages(self) -> list[torch.Tensor | None]:
        tensors = []
        for flat in self._flat_params():
            tensors.append(getattr(flat, "_local_shard", flat))
            tensors.append(getattr(flat, "_full_param_padded", None))
        return tensors

    def _shard_storages(self) -> list[torch.Tensor]:
        return [getattr(f, "_local_shard", f) for f in self._flat_params()]

    def _grad_storages(self) -> list[torch.Tensor | None]:
        flats = self._flat_params()
        return (
            super()._grad_storages() + [f.grad for f in flats] + [getattr(f, "_saved_grad_shard", None) for f in flats]
        )
