"""Models: plain single-device networks (CIFAR-10 classifiers and a GPT on token data). They know
nothing of parallelism.

All are ``nn.Sequential`` of coarse blocks, which is all a pipeline strategy needs to cut them into
contiguous stages, and all a tensor-parallel strategy needs to find the layers it splits.
"""

from __future__ import annotations

from typing import Callable

import torch
from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.gpt import GPT, MLPS, POSITIONS, PRESETS, gpt_sizes
from parallel_lab.models.moe import MOE_DEFAULTS, moe_layers
from parallel_lab.models.resnet import ResNet18
from parallel_lab.models.vit import DEFAULTS as VIT_DEFAULTS
from parallel_lab.models.vit import IMAGE, ViT

MODELS = {"cnn": SmallCNN, "resnet18": ResNet18, "vit": ViT, "gpt": GPT}
IMAGE_SHAPE = (3, IMAGE, IMAGE)  # one CIFAR image: the input of cnn, resnet18 and vit
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
    _validate_moe(cfg)
    if cfg.name == "gpt":
        _validate_gpt(cfg)


def vit_sizes(cfg: DictConfig) -> dict:
    """The vit's sizes: each model.<key> the config sets, else the vit's default (models/vit.py)."""
    return {key: default if cfg.get(key) is None else cfg.get(key) for key, default in VIT_DEFAULTS.items()}


def moe_options(cfg: DictConfig) -> dict:
    """The model.moe_* keys: each the config sets, else its default (models/moe.py MOE_DEFAULTS)."""
    return {key: default if cfg.get(key) is None else cfg.get(key) for key, default in MOE_DEFAULTS.items()}


def _validate_moe(cfg: DictConfig) -> None:
    m = moe_options(cfg)
    if not m["moe_experts"]:
        return
    if cfg.name != "vit":
        raise ConfigError(f"model.moe_experts={m['moe_experts']}: only the vit has MoE layers; use model=vit")
    for key, low in (("moe_experts", 1), ("moe_topk", 1), ("moe_every", 1)):
        if not isinstance(m[key], int) or isinstance(m[key], bool) or m[key] < low:
            raise ConfigError(f"model.{key}={m[key]} must be an integer >= {low}; e.g. model.{key}=2")
    if m["moe_topk"] > m["moe_experts"]:
        raise ConfigError(
            f"model.moe_topk={m['moe_topk']} exceeds model.moe_experts={m['moe_experts']}; "
            f"use model.moe_topk<={m['moe_experts']}"
        )
    if m["moe_every"] > vit_sizes(cfg)["depth"]:
        raise ConfigError(
            f"model.moe_every={m['moe_every']} > model.depth={vit_sizes(cfg)['depth']} leaves no MoE block; "
            "use model.moe_every=2"
        )
    cf = m["moe_capacity_factor"]
    if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
        raise ConfigError(f"model.moe_capacity_factor={cf} must be > 0 (null = dropless); e.g. 1.25")
    if vit_sizes(cfg)["dropout"]:
        raise ConfigError(
            f"model.dropout={vit_sizes(cfg)['dropout']} with MoE layers: experts reorder tokens, a sample's "
            "mask cannot follow them; use model.dropout=0"
        )


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


def _validate_gpt(cfg: DictConfig) -> None:
    preset = cfg.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"model.preset={preset} is unknown; use one of: {', '.join(PRESETS)}")
    if norm_of(cfg) != "group" or float(cfg.get("width", 1.0)) != 1.0:
        raise ConfigError(
            "model=gpt has LayerNorm and takes its widths from model.hidden/model.ffn; "
            "drop model.norm and model.width (use model.hidden=<n>)"
        )
    s = gpt_sizes(cfg)
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ConfigError(f"model.{key}={s[key]} must be an integer >= 1; e.g. model.{key}=64")
    if s["hidden"] % s["heads"] or (s["hidden"] // s["heads"]) % 2:
        raise ConfigError(
            f"model.heads={s['heads']} must divide model.hidden={s['hidden']} into an even head width; "
            f"use e.g. model.hidden={s['heads'] * 16}"
        )
    if s["heads"] % s["kv_heads"]:
        raise ConfigError(
            f"model.kv_heads={s['kv_heads']} must divide model.heads={s['heads']} (each kv head serves "
            f"heads / kv_heads query heads); use model.kv_heads={s['heads']} or a divisor of it"
        )
    for key, allowed in (("positions", POSITIONS), ("mlp", MLPS)):
        if s[key] not in allowed:
            raise ConfigError(f"model.{key}={s[key]} is unknown; use model.{key}={'|'.join(allowed)}")
    if not (isinstance(s["dropout"], (int, float)) and 0 <= s["dropout"] < 1):
        raise ConfigError(f"model.dropout={s['dropout']} must be in [0, 1); use model.dropout=0 (off, the default)")


def _kwargs(cfg: DictConfig) -> dict:
    if cfg.name == "gpt":
        return gpt_sizes(cfg)
    common = {"num_classes": cfg.num_classes, "width": float(cfg.get("width", 1.0)), "norm": norm_of(cfg)}
    return {**common, **vit_sizes(cfg), **moe_options(cfg)} if cfg.name == "vit" else common


def sample_shape(cfg: DictConfig) -> tuple[int, ...]:
    """One sample's input shape: a CIFAR image (3, 32, 32), or gpt's sequence of model.seq token ids."""
    return (gpt_sizes(cfg)["seq"],) if cfg.name == "gpt" else IMAGE_SHAPE


def input_shape(model: torch.nn.Module) -> tuple[int, ...]:
    """One sample's input shape for a built model: its ``input_shape`` (gpt: (seq,)), else an image."""
    return tuple(getattr(model, "input_shape", IMAGE_SHAPE))


def sample_input(
    module: torch.nn.Module, batch: int, shape: tuple, dtype: torch.dtype = torch.float32, device: str = "meta"
) -> torch.Tensor:
    """A batch of ``module``'s input (a model, or a pipeline stage of one): int64 token ids where
    its first layer embeds tokens (gpt's ``embed``), else ``dtype`` values (images, activations)."""
    first = next(iter(module.children()), module) if isinstance(module, torch.nn.Sequential) else module
    if getattr(first, "takes_tokens", False):
        return torch.zeros(batch, *shape, dtype=torch.long, device=device)
    return torch.empty(batch, *shape, dtype=dtype, device=device)


def loss_target(logits: torch.Tensor) -> torch.Tensor:
    """Class-index labels shaped for ``logits`` (classes in dim 1): (batch,) or gpt's (batch, seq)."""
    return torch.zeros(logits.shape[:1] + logits.shape[2:], dtype=torch.long, device=logits.device)


def build_model(cfg: DictConfig, seed: int) -> torch.nn.Sequential:
    """The same weights for the same seed, in every process and every strategy."""
    validate_model_config(cfg)
    torch.manual_seed(seed)
    extra = {"seed": seed} if cfg.name in ("vit", "gpt") else {}  # dropout masks are keyed by it
    return MODELS[cfg.name](**_kwargs(cfg), **extra)


def build_meta_model(cfg: DictConfig) -> torch.nn.Sequential:
    """The model's structure on the meta device: shapes for planning and estimates, no memory used
    and no random numbers drawn."""
    validate_model_config(cfg)
    with torch.device("meta"):
        return MODELS[cfg.name](**_kwargs(cfg))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def training_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the strategies backpropagate: cross-entropy, plus the MoE layers' weighted
    load-balancing losses of the same forward where the model has any (models/moe.py)."""
    cross_entropy = torch.nn.CrossEntropyLoss()
    aux = getattr(model, "aux", None)
    if aux is None or not moe_layers(model):
        return cross_entropy

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets) + aux.total().to(logits.dtype)

    return loss
