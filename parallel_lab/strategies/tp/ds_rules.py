"""Parent-side rules of ``strategy=tp strategy.impl=deepspeed``: the AutoTP layer specs per model,
the DeepSpeed config, its refusals and the planner's memory prediction, apart from
``ds_autotp.py`` so that ``rules.py`` needs nothing of the strategy."""

from __future__ import annotations

import re

from omegaconf import DictConfig
from torch import nn

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.memory import chunk_rows, predicted_optimizer_bytes

# model -> (column-parallel Linear names, row-parallel Linear names), as regexes over module names
DS_TP_SPECS: dict[str, tuple[str, str]] = {
    "vit": (r"block\d+\.attn\.[qkv]|block\d+\.mlp\.fc1", r"block\d+\.attn\.proj|block\d+\.mlp\.fc2"),
    "cnn": (r"fc1", r"fc2"),
}


def split_layers(model: nn.Module, model_name: str) -> dict[str, str]:
    """Linear name -> "column" | "row", model order."""
    column, row = DS_TP_SPECS[model_name]
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and re.fullmatch(column, name):
            kinds[name] = "column"
        elif isinstance(module, nn.Linear) and re.fullmatch(row, name):
            kinds[name] = "row"
    return kinds


def autotp_ds_config(cfg: DictConfig) -> dict:
    t = cfg.trainer
    column, row = DS_TP_SPECS[cfg.model.name]
    micro = t.global_batch // t.grad_accum  # every tp rank sees the whole batch (one replica)
    return {
        # DeepSpeed's batch check counts all ranks as data-parallel (docs/facts.md)
        "train_batch_size": micro * t.grad_accum * cfg.world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": 0.0,  # the tp strategy's clip runs before engine.step() instead
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "tensor_parallel": {
            "autotp_size": cfg.strategy.tp,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [rf"^(.*\.)?({column})\.weight$"], "partition_type": "column"},
                    {"patterns": [rf"^(.*\.)?({row})\.weight$"], "partition_type": "row"},
                ],
            },
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def held_numels(model: nn.Module, kinds: dict[str, str], tp: int, rank: int) -> list[int]:
    """Element count of every parameter tp rank ``rank`` holds (DeepSpeed splits even widths as
    torch.chunk does), model order."""
    numels = []
    for name, p in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        split = kinds.get(layer)
        dim = 0 if split == "column" else 1 if split == "row" and kind == "weight" else None
        if dim is None:
            numels.append(p.numel())
        else:
            numels.append(p.numel() // p.shape[dim] * chunk_rows(p.shape[dim], tp, rank)[0])
    return numels


def predict_autotp_memory(cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
    """This rank's slices plus everything replicated, torch Adam's state for exactly those tensors."""
    numels = held_numels(model, split_layers(model, cfg.model.name), cfg.strategy.tp, rank % cfg.strategy.tp)
    return {
        "param_bytes": 4 * sum(numels),
        "grad_bytes": 4 * sum(numels),
        "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
    }


def check_deepspeed_tp(opts: DictConfig, cfg: DictConfig) -> None:
    """The parent's refusals for ``strategy.impl=deepspeed`` (ConfigError, one line)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "strategy.impl=deepspeed needs DeepSpeed, which is not installed; pip install deepspeed (make installs "
            "it), or use strategy.impl=manual"
        )
    if cfg.model.name not in DS_TP_SPECS:
        raise ConfigError(
            f"strategy=tp strategy.impl=deepspeed has no AutoTP layer specs for model={cfg.model.name}; "
            f"use model={' or model='.join(DS_TP_SPECS)}"
        )
    if opts.replicate != 1:
        raise ConfigError(
            f"strategy.replicate={opts.replicate} with strategy.impl=deepspeed: dp x tp over DeepSpeed's own groups "
            f"is not built here; use strategy.replicate=1 or strategy.impl=manual"
        )
    if cfg.model.get("dropout"):
        raise ConfigError(
            f"model.dropout={cfg.model.dropout} with strategy=tp strategy.impl=deepspeed: each rank would draw the "
            f"masks of its slice of the split layers' outputs, not single's (measured, docs/facts.md); set "
            f"model.dropout=0"
        )
    if opts.split_conv:
        raise ConfigError("strategy.split_conv=true needs strategy.impl=manual (AutoTP splits nn.Linear only)")
    if opts.get("sequence_parallel"):
        raise ConfigError(
            "strategy.sequence_parallel=true with strategy.impl=deepspeed: AutoTP training has no sequence-parallel "
            "regions; use strategy.impl=manual or strategy.impl=dtensor"
        )
    from parallel_lab.models import build_meta_model

    model = build_meta_model(cfg.model)
    for name, kind in split_layers(model, cfg.model.name).items():
        width = model.get_submodule(name).weight.shape[0 if kind == "column" else 1]
        if width % opts.tp:
            raise ConfigError(
                f"strategy.tp={opts.tp} does not divide the {width} features {name} splits; "
                f"use a strategy.tp that divides {width} (e.g. strategy.tp=2)"
            )
    if cfg.world_size != opts.tp:
        raise ConfigError(
            f"strategy.tp={opts.tp} must equal world_size={cfg.world_size} with strategy.impl=deepspeed; "
            f"set strategy.tp={cfg.world_size}"
        )
