"""The models as they were built before model.norm existed (parallel_lab/models at 5686ea3^), frozen
here as the reference of tests/integration/test_batchnorm.py's "built bit for bit as before".

A digest of the weights recorded on one CPU is not the same bits on another (ATen's default kernels
draw torch's initial weights differently from its AVX2/AVX-512 ones: docs/testing.md), so the test
rebuilds the old construction on the machine it runs on and compares bits with today's. Any change
to what the default model draws (layers, their order, shapes, the seed, an extra random draw) still
shows, because this copy does not follow the code under test. Keep it as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


class SmallCNN(nn.Sequential):
    def __init__(self, num_classes: int = 10, hidden: int = 256, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, hidden = (max(1, round(c * width)) for c in (32, 64, hidden))
        self.add_module("block1", _conv_block(3, c1))
        self.add_module("block2", _conv_block(c1, c2))
        self.add_module("block3", _conv_block(c2, c2))
        self.add_module("flatten", nn.Flatten())
        self.add_module("fc1", nn.Linear(c2 * 4 * 4, hidden))
        self.add_module("relu", nn.ReLU())
        self.add_module("fc2", nn.Linear(hidden, num_classes))


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels // 2), channels)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = _norm(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(c_out))


def _stage(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(_BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1))


def _scaled(channels: int, width: float) -> int:
    return max(32, round(channels * width / 32) * 32)


class ResNet18(nn.Sequential):
    def __init__(self, num_classes: int = 10, width: float = 1.0) -> None:
        super().__init__()
        c64, c128, c256, c512 = (_scaled(c, width) for c in (64, 128, 256, 512))
        self.add_module("stem", nn.Sequential(nn.Conv2d(3, c64, 3, 1, 1, bias=False), _norm(c64), nn.ReLU()))
        self.add_module("layer1", _stage(c64, c64, 1))
        self.add_module("layer2", _stage(c64, c128, 2))
        self.add_module("layer3", _stage(c128, c256, 2))
        self.add_module("layer4", _stage(c256, c512, 2))
        self.add_module("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
        self.add_module("fc", nn.Linear(c512, num_classes))


def build_model_before_norm(name: str, num_classes: int, width: float, seed: int) -> nn.Sequential:
    """What build_model(cfg, seed) returned before model.norm: seed, then construct."""
    torch.manual_seed(seed)
    return {"cnn": SmallCNN, "resnet18": ResNet18}[name](num_classes=num_classes, width=width)
