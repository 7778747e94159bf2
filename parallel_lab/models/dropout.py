"""Dropout whose mask for a sample is the same however the batch is split (docs/vit.md).

``nn.Dropout`` draws one mask for the whole batch from the process's RNG: a data-parallel rank
draws for its shard only, from its own stream, so every row with dropout on trains a different
network than single. Here the mask of a sample is a function of (model seed, the sample, how
many times this model has trained on it, which dropout layer): a rank holding samples 32..63 of a
global batch draws, for each, the mask single draws for it.

The sample is known by its pixels (a hash of the bytes the model's first layer receives), so the
model needs nothing from the training loop and stays free of parallelism. What this cannot see:
- a layer whose process never sees the pixels (a pipeline stage after the first) draws from the
  process's RNG, as ``nn.Dropout`` does;
- the occurrence count lives in the process: a run resumed from a checkpoint counts again from 0
  (identical to an uninterrupted run within the first epoch only).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter

import torch
from torch import nn


class SampleKeys:
    """The keys of the batch in flight, shared by a model's first layer (which sets them) and its
    dropout layers (which read them)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.keys: list[bytes] | None = None
        self.seen: Counter = Counter()  # training forwards per sample: a new mask each epoch

    def set(self, pixels: torch.Tensor) -> None:
        """Key every sample of a training batch by (seed, its bytes, its occurrence)."""
        if pixels.is_meta:
            return
        rows = pixels.detach().cpu().contiguous().reshape(len(pixels), -1).view(torch.uint8).numpy()  # any dtype
        self.keys = []
        for row in rows:
            digest = hashlib.blake2b(row.tobytes(), digest_size=16).digest()
            self.keys.append(digest + struct.pack("<qq", self.seed, self.seen[digest]))
            self.seen[digest] += 1


class SampleDropout(nn.Module):
    """Dropout(p) with per-sample masks from ``keys`` (``site`` tells the layers apart); the
    process's RNG where no keys match the batch. Saves a bool mask for backward, as nn.Dropout."""

    def __init__(self, p: float, keys: SampleKeys, site: int) -> None:
        super().__init__()
        self.p, self.keys, self.site = p, keys, site

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return torch.where(self._keep(x), x * (1.0 / (1.0 - self.p)), 0.0)

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.keys.keys
        if x.is_meta:
            return torch.empty(x.shape, dtype=torch.bool, device="meta")
        if keys is None or len(keys) != len(x):  # no pixels seen in this process (a later pipeline stage)
            return torch.rand(x.shape, device=x.device) >= self.p
        generator, site = torch.Generator(), struct.pack("<q", self.site)
        masks = []
        for key in keys:
            seed = int.from_bytes(hashlib.blake2b(key + site, digest_size=8).digest(), "little") >> 1
            masks.append(torch.rand(x.shape[1:], generator=generator.manual_seed(seed)) >= self.p)
        return torch.stack(masks).to(x.device)
