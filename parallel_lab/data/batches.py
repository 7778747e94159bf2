"""The datasets every rank loads and the batch order every strategy shares (the package root
explains the order)."""

from __future__ import annotations

from typing import Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DistributedSampler, TensorDataset

from parallel_lab.data.cifar10 import load_cifar10
from parallel_lab.data.specs import _synthetic_sizes
from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.data.tokens import byte_windows, markov_tokens


def load_datasets(cfg: DictConfig, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval) datasets of normalised float images and int64 labels, or of token ids and
    next tokens (data=tokens: a text file's bytes, or the synthetic chain of trainer.seed)."""
    if cfg.name == "tokens":
        if cfg.get("path"):
            return byte_windows(cfg.path, cfg.seq)
        train_size, eval_size = _synthetic_sizes(cfg.size)
        return (
            markov_tokens(train_size, cfg.seq, cfg.vocab, seed, table_seed=seed),
            markov_tokens(eval_size, cfg.seq, cfg.vocab, seed + 1, table_seed=seed),
        )
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
