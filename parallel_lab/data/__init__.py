"""Data: CIFAR-shaped tensors and the batch order every strategy shares.

Every strategy sees the same global batch at every step: a DistributedSampler shuffles with the
same seed and epoch everywhere (its permutation does not depend on the number of replicas), rank r
takes every N-th index, so the union of the ranks' batches at step s is exactly the single-process
batch s. Tensor/pipeline-parallel strategies have a data-parallel size of 1 and see the whole batch.
"""

from __future__ import annotations

from typing import Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DistributedSampler, TensorDataset

from parallel_lab.data.cifar10 import load_cifar10, tarball_images, validate_cifar_config
from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.errors import ConfigError

DATASETS = ("synthetic", "cifar10")


def validate_data_config(cfg: DictConfig, trainer: DictConfig) -> None:
    if cfg.name not in DATASETS:
        raise ConfigError(f"unknown data '{cfg.name}'; choose one of: {', '.join(DATASETS)} (data=<name>)")
    if cfg.name == "cifar10":
        validate_cifar_config(cfg)
    elif cfg.size < trainer.global_batch:
        raise ConfigError(
            f"data.size={cfg.size} is smaller than trainer.global_batch={trainer.global_batch}; "
            f"raise data.size to at least {trainer.global_batch}"
        )


def images_per_rank(cfg: DictConfig) -> int:
    """About how many images every rank loads (each holds the whole dataset), for the memory check."""
    return sum(_synthetic_sizes(cfg.size)) if cfg.name == "synthetic" else tarball_images(cfg)


def _synthetic_sizes(size: int) -> tuple[int, int]:
    """(training, held-out) samples of data=synthetic: the held-out set is an eighth, at least 64."""
    return size, max(size // 8, 64)


def load_datasets(cfg: DictConfig, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval) datasets of normalised float images and int64 labels."""
    if cfg.name == "synthetic":
        train_size, eval_size = _synthetic_sizes(cfg.size)
        return make_synthetic(train_size, seed), make_synthetic(eval_size, seed + 1)
    return load_cifar10(cfg)


def train_batches(
    dataset: TensorDataset, global_batch: int, dp_rank: int, dp_size: int, seed: int, start_batch: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless per-rank batches of global_batch / dp_size samples, epoch after epoch, starting at
    batch start_batch of the sequence (a resumed run continues exactly where its checkpoint was)."""
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
    per_rank = global_batch // dp_size
    per_epoch = len(sampler) // per_rank
    epoch, skip = divmod(start_batch, per_epoch)
    images, labels = dataset.tensors
    while True:
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        order = torch.tensor(list(sampler), dtype=torch.int64)
        for b in range(skip, per_epoch):
            index = order[b * per_rank : (b + 1) * per_rank]
            yield images[index], labels[index]
        skip, epoch = 0, epoch + 1


def eval_batches(
    dataset: TensorDataset, batch: int, num_batches: int, dp_rank: int, dp_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the first num_batches * batch held-out samples (no shuffling)."""
    # Whole batches only, so every rank runs the same number of (possibly collective) forwards.
    count = min(len(dataset), batch * num_batches) // batch * batch
    for start in range(dp_rank * batch // dp_size, count, batch):
        stop = min(start + batch // dp_size, count)
        yield dataset.tensors[0][start:stop], dataset.tensors[1][start:stop]
