"""A small CIFAR-10 CNN (~0.3M parameters): three conv blocks and a two-layer classifier head.

It has no normalisation layer (``norm="group"``, the default, keeps it so). ``norm="batch"`` or
``"syncbatch"`` puts a BatchNorm2d (Ioffe & Szegedy, arXiv 1502.03167) after each convolution, the
way a user adds one: the smallest model that shows what each strategy does to batch statistics.
"""

import torch.nn as nn

from parallel_lab.models.counts import ACTIVATION_BYTES_PER_SAMPLE
from parallel_lab.models.layout import CNN_HIDDEN, cnn_widths


def conv_block(c_in: int, c_out: int, norm: str = "group") -> nn.Sequential:
    if norm == "group":  # the cnn as it always was: no normalisation layer
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))


class SmallCNN(nn.Sequential):
    """32x32x3 -> 16x16x32 -> 8x8x64 -> 4x4x64 -> 256 hidden -> classes."""

    # Bytes autograd saves for backward per sample of batch, for the memory check before a run
    # (parallel_lab/config/resources.py); tests/unit/test_resources.py recounts them from a real forward.
    activation_bytes_per_sample = ACTIVATION_BYTES_PER_SAMPLE["cnn"]

    def __init__(
        self, num_classes: int = 10, hidden: int = CNN_HIDDEN, width: float = 1.0, norm: str = "group"
    ) -> None:
        super().__init__()
        c1, c2, hidden, features = cnn_widths(width, hidden)  # width 1: 32, 64, 256, 64 x 4 x 4
        self.add_module("block1", conv_block(3, c1, norm))
        self.add_module("block2", conv_block(c1, c2, norm))
        self.add_module("block3", conv_block(c2, c2, norm))
        self.add_module("flatten", nn.Flatten())
        # fc1 then fc2: the column-parallel / row-parallel pair of the Megatron-style TP split.
        self.add_module("fc1", nn.Linear(features, hidden))
        self.add_module("relu", nn.ReLU())
        self.add_module("fc2", nn.Linear(hidden, num_classes))
