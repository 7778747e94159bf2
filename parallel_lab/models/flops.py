"""Forward FLOPs of a module's layers, counted on the meta device (nothing allocated): what the
planner's step-time model and the strategies' splits of the compute are measured in."""

from __future__ import annotations

import torch
from torch import nn

from parallel_lab.models import input_shape, sample_input
from parallel_lab.models.gpt import Head
from parallel_lab.models.vit import AttentionCore


def _flops(mod: nn.Module, output: torch.Tensor) -> float:
    if isinstance(mod, nn.Linear):
        return 2.0 * output.numel() * mod.in_features
    if isinstance(mod, Head):  # gpt's output projection (its own or the tied embedding's weight)
        return 2.0 * output.numel() * mod.norm.normalized_shape[0]
    if isinstance(mod, AttentionCore):  # output (batch, heads, tokens, head_dim): two tokens x tokens matmuls
        return 2 * 2.0 * output.numel() * output.shape[-2]
    k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
    return 2.0 * output.numel() * k


def layer_flops(module: nn.Module, batch: int, sample_shape: tuple | None = None) -> dict[str, float]:
    """Forward multiply-add FLOPs of every Conv2d/Linear and of every attention core's two matmuls
    (q k^T and probs v), by qualified name, from a meta-device forward (nothing allocated) of
    ``sample_shape`` samples (default: the model's own input, models.input_shape). Other
    layers (ReLU/GELU, pooling, norms, softmax, residual adds) are left out: a small part of these
    models' time, and the model's error table shows what that costs."""
    flops: dict[str, float] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inputs, output, name=name: flops.__setitem__(name, _flops(mod, output)))
        for name, m in module.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear, AttentionCore, Head))
    ]
    try:
        with torch.no_grad():
            module(sample_input(module, batch, sample_shape or input_shape(module)))
    finally:
        for h in hooks:
            h.remove()
    return flops


def kernel_kind(module: nn.Module) -> str:
    """Which measured kernel a counted layer's FLOPs run on: "conv" (Conv2d) or "matmul" (Linear
    and attention's two matmuls); a peak is measured for each (worker/metrics.py measure_peak)."""
    return "conv" if isinstance(module, nn.Conv2d) else "matmul"


def flops_by_kind(module: nn.Module, batch: int, sample_shape: tuple | None = None) -> dict[str, float]:
    """layer_flops summed by kernel_kind: the model's mix of convolution and matrix-product work."""
    kinds = {name: kernel_kind(m) for name, m in module.named_modules()}
    out = {"conv": 0.0, "matmul": 0.0}
    for name, flops in layer_flops(module, batch, sample_shape).items():
        out[kinds[name]] += flops
    return out
