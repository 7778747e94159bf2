"""ZeRO's model state (``ZeroState``): DeepSpeed's own checkpoint format, each rank writing its
optimizer partition; a strategy-neutral full state scattered into DeepSpeed's partitions
(``trainer.reshard=true``); the full parameters gathered for the parity check."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.state import State

DS_TAG = "deepspeed"  # the subfolder DeepSpeed writes inside one of our step_* checkpoints


class ZeroState(State):
    @property
    def engine(self):
        return self.strategy.engine

    def save(self, directory: Path) -> None:
        # save_latest=False: our complete.json, not DeepSpeed's "latest" file, says what is finished.
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        from parallel_lab.checkpoint.ds_reader import use_weights_only_loading

        use_weights_only_loading(self.engine)
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ConfigError(
                f"checkpoint '{directory}' holds no DeepSpeed state under tag '{DS_TAG}'; "
                f"trainer.resume=never to start fresh"
            )

    # ----- resharding (trainer.reshard=true; what it refuses: ZeroPlan.reshard_refusal) -----
    @torch.no_grad()
    def load_full(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Stage 0 holds a plain replica; stages 1-2 get their flat fp32 partition cut from the full
        tensors laid out as their bit16 flat buffer; stage 3 goes through DeepSpeed's own
        ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (ZeRO, arXiv 1910.02054)."""
        opt, module = self.engine.optimizer, self.engine.module
        for name, buffer in module.named_buffers():
            buffer.copy_(model_state[name])
        if self.opts.stage == 0:
            from parallel_lab.strategies.replicated import copy_tensors_into, indexed_optimizer_state

            copy_tensors_into(module, model_state)
            opt.load_state_dict(indexed_optimizer_state(opt, module, optim_state))
            return
        names = {id(p): n for n, p in module.named_parameters()}
        step = next(iter(optim_state.values()), {}).get("step")
        if self.opts.stage == 3:
            self._load_full_stage3(opt, module, model_state, optim_state, step)
        else:
            self._load_full_stage12(opt, names, model_state, optim_state, step)
            for name, p in module.named_parameters():
                p.data.copy_(model_state[name])

    def _load_full_stage12(self, opt, names: dict, model_state: dict, optim_state: dict, step) -> None:
        """Each group's full flat vector is the bit16 flat buffer's layout (parameter offsets read
        from where each parameter's view starts); this rank keeps partition_size elements of it,
        filled parameter by parameter from the part of each that falls into the partition."""
        import torch.distributed as dist

        for g, flat in enumerate(opt.bit16_groups_flat):
            size = int(opt.partition_size[g])
            start = dist.get_rank(group=opt.real_dp_process_group[g]) * size
            master = opt.single_partition_of_fp32_groups[g]
            mine = {key: torch.zeros(size, dtype=torch.float32) for key in ("param", "exp_avg", "exp_avg_sq")}
            for p in opt.bit16_groups[g]:
                offset = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
                lo, hi = max(offset, start), min(offset + p.numel(), start + size)
                if lo >= hi:
                    continue  # the parameter lies in another rank's partition
                name = names[id(p)]
                part = slice(lo - offset, hi - offset)
                mine["param"][lo - start : hi - start] = model_state[name].flatten()[part]
                for key in ("exp_avg", "exp_avg_sq"):
                    if name in optim_state:
                        mine[key][lo - start : hi - start] = optim_state[name][key].flatten()[part]
            master.data.copy_(mine["param"])
            if step is not None:
                opt.optimizer.state[master] = {
                    "step": step.clone(),
                    **{k: mine[k].to(master.device) for k in ("exp_avg", "exp_avg_sq")},
                }

    def _load_full_stage3(self, opt, module, model_state: dict, optim_state: dict, step) -> None:
        """DeepSpeed's own setters, once the Adam state they write into exists (torch creates it
        lazily at the first step); then each parameter's partition is refreshed from the master."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if step is not None:
            for master in opt.fp32_partitioned_groups_flat:
                opt.optimizer.state[master] = {
                    "step": step.clone(),
                    "exp_avg": torch.zeros_like(master),
                    "exp_avg_sq": torch.zeros_like(master),
                }
        for name, p in module.named_parameters():
            safe_set_full_fp32_param(p, model_state[name])
            if step is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, optim_state[name][key], key)
            group, offset, numel = opt.grad_position[opt.get_param_id(p)]
            master = opt.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
            p.ds_tensor.data.narrow(0, 0, numel).copy_(master)

    def full_parameters(self) -> list[torch.Tensor]:
        if self.strategy.experts is not None:  # strategy.ep: each layer's experts gathered (ds_moe.py)
            return self.strategy.experts.full_parameters(self.engine.module)
        if self.opts.stage == 3:
            import deepspeed

            params = list(self.engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return [p.detach().clone().float() for p in params]
        return [p.detach().float() for p in self.engine.module.parameters()]
