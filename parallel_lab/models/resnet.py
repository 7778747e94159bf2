"""CIFAR ResNet-18 (He et al. 2015, 3x3 stem for 32x32 inputs), ~11.2M parameters.

GroupNorm instead of BatchNorm, on purpose: BatchNorm normalises over each process's local batch,
so its loss depends on how the global batch is split and no strategy could match the single-process
baseline exactly. GroupNorm is per-sample, so every split computes the same function.
"""

import torch
import torch.nn as nn


def norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels // 2), channels)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = norm(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def stage(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1))


def scaled(channels: int, width: float) -> int:
    """channels x width, rounded to a multiple of 32 (GroupNorm's 32 groups must divide it);
    width 1 keeps 64, 128, 256, 512."""
    return max(32, round(channels * width / 32) * 32)


class ResNet18(nn.Sequential):
    # Bytes autograd saves for backward per sample of batch, for the memory check before a run
    # (parallel_lab/resources.py); tests/unit/test_resources.py recounts them from a real forward.
    activation_bytes_per_sample = 4_705_328

    def __init__(self, num_classes: int = 10, width: float = 1.0) -> None:
        super().__init__()
        c64, c128, c256, c512 = (scaled(c, width) for c in (64, 128, 256, 512))
        self.add_module("stem", nn.Sequential(nn.Conv2d(3, c64, 3, 1, 1, bias=False), norm(c64), nn.ReLU()))
        self.add_module("layer1", stage(c64, c64, 1))
        self.add_module("layer2", stage(c64, c128, 2))
        self.add_module("layer3", stage(c128, c256, 2))
        self.add_module("layer4", stage(c256, c512, 2))
        self.add_module("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
        self.add_module("fc", nn.Linear(c512, num_classes))
