"""What the parent checks of ``data.*`` (torch-free): the dataset names, their sizes, the checks."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.data.cifar10 import tarball_images, validate_cifar_config
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
