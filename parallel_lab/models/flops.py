"""Forward FLOPs of a module's layers, counted on the meta device (nothing allocated): what the
planner's step-time model and the strategies' splits of the compute are measured in."""

from __future__ import annotations

import torch
from torch import nn


def layer_flops(module: nn.Module, batch: int, sample_shape: tuple = (3, 32, 32)) -> dict[str, float]:
    """Forward multiply-add FLOPs of every Conv2d/Linear, by qualified name, from a meta-device
    forward (nothing allocated). Other layers (ReLU, pooling, norms) are left out: they are a small
    part of a convnet's time, and the model's error table shows what that costs."""
    flops: dict[str, float] = {}
    hooks = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):

            def hook(mod, inputs, output, name=name):
                if isinstance(mod, nn.Linear):
                    flops[name] = 2.0 * output.numel() * mod.in_features
                else:
                    k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
                    flops[name] = 2.0 * output.numel() * k

            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(torch.empty(batch, *sample_shape, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return flops
