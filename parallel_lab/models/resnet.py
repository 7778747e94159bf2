"""CIFAR ResNet-18 (He et al. 2015, 3x3 stem for 32x32 inputs), ~11.2M parameters.

GroupNorm by default, on purpose: BatchNorm (Ioffe & Szegedy, arXiv 1502.03167) normalises over
each process's local batch, so its loss depends on how the global batch is split. GroupNorm is
per-sample, so every split computes the same function. ``norm="batch"`` builds the BatchNorm2d
ResNet users write (docs/batchnorm.md shows what each strategy does to it); ``"syncbatch"`` builds
the same, for a data-parallel strategy to convert (the model knows nothing of parallelism).
"""

import torch
import torch.nn as nn

from parallel_lab.models.counts import ACTIVATION_BYTES_PER_SAMPLE
from parallel_lab.models.layout import RESNET_CHANNELS, scaled


def norm_layer(channels: int, kind: str = "group") -> nn.Module:
    """The normalisation layer of ``model.norm`` (parallel_lab/config/schema.py Norm)."""
    if kind == "group":
        return nn.GroupNorm(min(32, channels // 2), channels)
    return nn.BatchNorm2d(channels)  # batch and syncbatch: the strategy converts the latter


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, kind: str = "group") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = norm_layer(c_out, kind)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = norm_layer(c_out, kind)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm_layer(c_out, kind))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def stage(c_in: int, c_out: int, stride: int, kind: str = "group") -> nn.Sequential:
    return nn.Sequential(BasicBlock(c_in, c_out, stride, kind), BasicBlock(c_out, c_out, 1, kind))


class ResNet18(nn.Sequential):
    # Bytes autograd saves for backward per sample of batch, for the memory check before a run
    # (parallel_lab/config/resources.py); tests/unit/test_resources.py recounts them from a real forward.
    activation_bytes_per_sample = ACTIVATION_BYTES_PER_SAMPLE["resnet18"]

    def __init__(self, num_classes: int = 10, width: float = 1.0, norm: str = "group") -> None:
        super().__init__()
        kind = norm
        c64, c128, c256, c512 = (scaled(c, width) for c in RESNET_CHANNELS)
        self.add_module("stem", nn.Sequential(nn.Conv2d(3, c64, 3, 1, 1, bias=False), norm_layer(c64, kind), nn.ReLU()))
        self.add_module("layer1", stage(c64, c64, 1, kind))
        self.add_module("layer2", stage(c64, c128, 2, kind))
        self.add_module("layer3", stage(c128, c256, 2, kind))
        self.add_module("layer4", stage(c256, c512, 2, kind))
        self.add_module("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
        self.add_module("fc", nn.Linear(c512, num_classes))
