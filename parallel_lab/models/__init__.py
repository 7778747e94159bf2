"""Models: plain single-device CIFAR-10 networks. They know nothing of parallelism.

Both are ``nn.Sequential`` of coarse blocks, which is all a pipeline strategy needs to cut them into
contiguous stages, and all a tensor-parallel strategy needs to find the layers it splits.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.resnet import ResNet18

MODELS = {"cnn": SmallCNN, "resnet18": ResNet18}
NORMS = ("group", "batch", "syncbatch")  # model.norm (config/schema.py Norm)


def norm_of(cfg: DictConfig) -> str:
    """model.norm as a plain string (a str-Enum in a typed config, a string in a loaded config.yaml)."""
    value = cfg.get("norm", "group")
    return getattr(value, "value", value)


def validate_model_config(cfg: DictConfig) -> None:
    if cfg.name not in MODELS:
        raise ConfigError(f"unknown model '{cfg.name}'; choose one of: {', '.join(MODELS)} (model=<name>)")
    width = cfg.get("width", 1.0)
    if not (isinstance(width, (int, float)) and 0 < width <= 1000):
        raise ConfigError(f"model.width={width} must be a number in (0, 1000]; use model.width=1 (the default)")
    if norm_of(cfg) not in NORMS:
        raise ConfigError(f"model.norm={norm_of(cfg)} is unknown; use model.norm={'|'.join(NORMS)} (default group)")


def _kwargs(cfg: DictConfig) -> dict:
    return {"num_classes": cfg.num_classes, "width": float(cfg.get("width", 1.0)), "norm": norm_of(cfg)}


def build_model(cfg: DictConfig, seed: int) -> torch.nn.Sequential:
    """The same weights for the same seed, in every process and every strategy."""
    validate_model_config(cfg)
    torch.manual_seed(seed)
    return MODELS[cfg.name](**_kwargs(cfg))


def build_meta_model(cfg: DictConfig) -> torch.nn.Sequential:
    """The model's structure on the meta device: shapes for planning and estimates, no memory used
    and no random numbers drawn."""
    validate_model_config(cfg)
    with torch.device("meta"):
        return MODELS[cfg.name](**_kwargs(cfg))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
