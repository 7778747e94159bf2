"""Models: plain single-device CIFAR-10 networks. They know nothing of parallelism.

All are ``nn.Sequential`` of coarse blocks, which is all a pipeline strategy needs to cut them into
contiguous stages, and all a tensor-parallel strategy needs to find the layers it splits.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.resnet import ResNet18
from parallel_lab.models.vit import DEFAULTS as VIT_DEFAULTS
from parallel_lab.models.vit import IMAGE, ViT

MODELS = {"cnn": SmallCNN, "resnet18": ResNet18, "vit": ViT}
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
    if cfg.name == "vit":
        _validate_vit(cfg)


def vit_sizes(cfg: DictConfig) -> dict:
    """The vit's sizes: each model.<key> the config sets, else the vit's default (models/vit.py)."""
    return {key: default if cfg.get(key) is None else cfg.get(key) for key, default in VIT_DEFAULTS.items()}


def _validate_vit(cfg: DictConfig) -> None:
    s = vit_sizes(cfg)
    if norm_of(cfg) != "group":
        raise ConfigError(
            f"model.norm={norm_of(cfg)}: the vit has LayerNorm, no BatchNorm to change; "
            "use model.norm=group (the default)"
        )
    for key in ("patch", "dim", "depth", "heads"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ConfigError(f"model.{key}={s[key]} must be an integer >= 1; use model.{key}={VIT_DEFAULTS[key]}")
    if IMAGE % s["patch"]:
        raise ConfigError(f"model.patch={s['patch']} does not divide the {IMAGE}-pixel image; use 1, 2, 4, 8, 16 or 32")
    if s["dim"] % s["heads"]:
        raise ConfigError(
            f"model.heads={s['heads']} does not divide model.dim={s['dim']}; use a dim that is a multiple of heads"
        )
    if not (isinstance(s["mlp_ratio"], (int, float)) and round(s["dim"] * s["mlp_ratio"]) >= 1):
        raise ConfigError(f"model.mlp_ratio={s['mlp_ratio']} gives no MLP width; use model.mlp_ratio=2")
    if not (isinstance(s["dropout"], (int, float)) and 0 <= s["dropout"] < 1):
        raise ConfigError(f"model.dropout={s['dropout']} must be in [0, 1); use model.dropout=0 (off, the default)")


def _kwargs(cfg: DictConfig) -> dict:
    common = {"num_classes": cfg.num_classes, "width": float(cfg.get("width", 1.0)), "norm": norm_of(cfg)}
    return {**common, **vit_sizes(cfg)} if cfg.name == "vit" else common


def build_model(cfg: DictConfig, seed: int) -> torch.nn.Sequential:
    """The same weights for the same seed, in every process and every strategy."""
    validate_model_config(cfg)
    torch.manual_seed(seed)
    extra = {"seed": seed} if cfg.name == "vit" else {}  # the vit's dropout masks are keyed by it
    return MODELS[cfg.name](**_kwargs(cfg), **extra)


def build_meta_model(cfg: DictConfig) -> torch.nn.Sequential:
    """The model's structure on the meta device: shapes for planning and estimates, no memory used
    and no random numbers drawn."""
    validate_model_config(cfg)
    with torch.device("meta"):
        return MODELS[cfg.name](**_kwargs(cfg))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
