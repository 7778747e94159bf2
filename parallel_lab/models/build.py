"""The networks by name (``MODELS``) and how every process builds them: the same weights for the
same seed (``build_model``), or the shapes alone on the meta device (``build_meta_model``); their
inputs and the loss the strategies backpropagate."""

from __future__ import annotations

from typing import Callable

import torch
from omegaconf import DictConfig

from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.gpt import GPT, gpt_sizes
from parallel_lab.models.moe import moe_layers
from parallel_lab.models.resnet import ResNet18
from parallel_lab.models.specs import IMAGE_SHAPE, MODEL_NAMES, moe_options, norm_of, validate_model_config, vit_sizes
from parallel_lab.models.vit import ViT

MODELS = dict(zip(MODEL_NAMES, (SmallCNN, ResNet18, ViT, GPT)))


def _kwargs(cfg: DictConfig) -> dict:
    if cfg.name == "gpt":
        return {**gpt_sizes(cfg), **moe_options(cfg)}
    common = {"num_classes": cfg.num_classes, "width": float(cfg.get("width", 1.0)), "norm": norm_of(cfg)}
    return {**common, **vit_sizes(cfg), **moe_options(cfg)} if cfg.name == "vit" else common


def _first_layer(module: torch.nn.Module) -> torch.nn.Module:
    return next(iter(module.children()), module) if isinstance(module, torch.nn.Sequential) else module


def input_shape(module: torch.nn.Module) -> tuple[int, ...]:
    """One sample's input shape for a model or a pipeline stage that starts at the model's first
    layer: its ``input_shape`` (gpt and its embedding: (seq,)), else an image."""
    for m in (module, _first_layer(module)):
        if hasattr(m, "input_shape"):
            return tuple(m.input_shape)
    return IMAGE_SHAPE


def sample_input(
    module: torch.nn.Module, batch: int, shape: tuple, dtype: torch.dtype = torch.float32, device: str = "meta"
) -> torch.Tensor:
    """A batch of ``module``'s input (a model, or a pipeline stage of one): int64 token ids where
    its first layer embeds tokens (gpt's ``embed``), else ``dtype`` values (images, activations)."""
    if getattr(_first_layer(module), "takes_tokens", False):
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
        total = aux.total()  # None on a pipeline's last chunk without MoE layers (pp/manual.py)
        return cross_entropy(logits, targets) + (0 if total is None else total.to(logits.dtype))

    return loss
