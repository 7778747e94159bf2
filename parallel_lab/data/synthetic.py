"""Synthetic CIFAR-shaped data, generated from the seed: no files, no download.

Each class has a fixed random 3x32x32 prototype; a sample is its class prototype plus noise, so
the task is learnable and losses fall the way they would on real data.
"""

import torch
from torch.utils.data import TensorDataset


def make_synthetic(size: int, seed: int, num_classes: int = 10) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, 3, 32, 32, generator=gen)
    labels = torch.randint(0, num_classes, (size,), generator=gen)
    images = 0.5 * prototypes[labels] + torch.randn(size, 3, 32, 32, generator=gen)
    return TensorDataset(images, labels)
