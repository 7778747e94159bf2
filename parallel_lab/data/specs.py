"""What the parent checks of ``data.*`` (torch-free): the dataset names, their sizes, the checks."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.data.cifar10 import tarball_images, validate_cifar_config
from parallel_lab.errors import ConfigError

DATASETS = ("synthetic", "cifar10", "tokens")
IMAGE_FLOAT_BYTES = 3 * 32 * 32 * 4  # one normalised image as the workers hold it
BYTE_VOCAB = 256  # data=tokens with data.path: a file read as bytes


def validate_data_config(cfg: DictConfig, trainer: DictConfig) -> None:
    if cfg.name not in DATASETS:
        raise ConfigError(f"unknown data '{cfg.name}'; choose one of: {', '.join(DATASETS)} (data=<name>)")
    if cfg.name == "cifar10":
        validate_cifar_config(cfg)
    elif cfg.name == "tokens" and cfg.get("path"):
        _validate_text_file(cfg, trainer)
    elif cfg.size < trainer.global_batch:
        raise ConfigError(
            f"data.size={cfg.size} is smaller than trainer.global_batch={trainer.global_batch}; "
            f"raise data.size to at least {trainer.global_batch}"
        )


def _validate_text_file(cfg: DictConfig, trainer: DictConfig) -> None:
    if not Path(cfg.path).expanduser().is_file():
        raise ConfigError(f"data.path={cfg.path} is not a file; give a text file's path (read as bytes)")
    if cfg.vocab != BYTE_VOCAB:
        raise ConfigError(f"data.vocab={cfg.vocab}: a file is read as bytes, vocabulary {BYTE_VOCAB}; drop data.vocab")
    windows = file_windows(cfg.path, cfg.seq)
    train = windows - max(1, windows // 10)
    if train < trainer.global_batch:
        raise ConfigError(
            f"data.path={cfg.path} gives {max(train, 0)} training windows of data.seq+1={cfg.seq + 1} bytes, "
            f"fewer than trainer.global_batch={trainer.global_batch}; use a longer file or a smaller batch"
        )


def file_windows(path: str | Path, seq: int) -> int:
    """How many windows of seq + 1 bytes a text file gives (train and held-out), from its size alone."""
    return max(0, (Path(path).expanduser().stat().st_size - 1) // seq)


def dataset_bytes(cfg: DictConfig) -> int:
    """About how many bytes of data every rank loads (each holds the whole dataset), for the memory check."""
    if cfg.name == "tokens":  # inputs and labels, int64
        samples = file_windows(cfg.path, cfg.seq) if cfg.get("path") else sum(_synthetic_sizes(cfg.size))
        return samples * 2 * cfg.seq * 8
    return IMAGE_FLOAT_BYTES * (sum(_synthetic_sizes(cfg.size)) if cfg.name == "synthetic" else tarball_images(cfg))


def _synthetic_sizes(size: int) -> tuple[int, int]:
    """(training, held-out) samples of data=synthetic and data=tokens: the held-out set is an eighth, at least 64."""
    return size, max(size // 8, 64)
