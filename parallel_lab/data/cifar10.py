"""The real CIFAR-10 "python version" tarball, read safely.

Format (https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-10-python.tar.gz`` holds
``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``, each a pickled dict with ``data`` (a
uint8 numpy array, N x 3072, channel-major 32x32 planes) and ``labels`` (a list of ints).

Pickle can run arbitrary code, so these members are read with a restricted unpickler that admits
only the globals this format needs to rebuild numpy arrays; anything else is refused. Members are
read straight from the archive, never extracted to disk.
"""

from __future__ import annotations

import functools
import io
import pickle
import tarfile
import urllib.request
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.hashing import file_digest

if TYPE_CHECKING:  # numpy and torch load in the functions that read or build arrays: the parent's
    # checks of data.* import neither
    import numpy as np
    from torch.utils.data import TensorDataset

TARBALL = "cifar-10-python.tar.gz"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TRAIN_MEMBERS = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)]
TEST_MEMBER = "cifar-10-batches-py/test_batch"
CLASSES = 10
IMAGE_BYTES = 3 * 32 * 32  # one image in the tarball: uint8, channel-major
DOWNLOAD_IMAGES = 60_000  # 50000 training + 10000 test images in the official tarball
MEAN = (0.4914, 0.4822, 0.4465)  # per channel
STD = (0.2470, 0.2435, 0.2616)

# The only globals a CIFAR batch pickle references (numpy 1.x and 2.x module names).
ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a CIFAR-10 batch")
        return super().find_class(module, name)


def restricted_loads(data: bytes) -> dict:
    return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()


def tarball_path(cfg: DictConfig) -> Path:
    return Path(cfg.root).expanduser() / TARBALL


def validate_cifar_config(cfg: DictConfig) -> None:
    if not cfg.root:
        raise ConfigError("data=cifar10 needs data.root; set data.root=<folder holding cifar-10-python.tar.gz>")
    path = tarball_path(cfg)
    if not path.is_file() and not cfg.download:
        raise ConfigError(f"data.root={cfg.root} has no {TARBALL}; put the tarball there or add data.download=true")


def tarball_images(cfg: DictConfig) -> int:
    """About how many images the tarball holds, from its size without opening it: gzip barely
    shrinks photos (the official 170 MB file holds 60000 x 3072 = 184 MB). Before a download: 60000."""
    path = tarball_path(cfg)
    return path.stat().st_size // IMAGE_BYTES if path.is_file() else DOWNLOAD_IMAGES


def download(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    urllib.request.urlretrieve(URL, partial)  # fixed https URL
    partial.rename(path)


def _field(batch: dict, key: str):
    return batch[key.encode()] if key.encode() in batch else batch[key]


def _read_member(tar: tarfile.TarFile, name: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    try:
        raw = tar.extractfile(name).read()
        batch = restricted_loads(raw)
        data = np.asarray(_field(batch, "data"), dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(_field(batch, "labels"), dtype=np.int64)
    except (
        KeyError,
        AttributeError,
        ValueError,
        TypeError,
        IndexError,
        EOFError,
    ) as exc:  # what a damaged pickle raises
        raise ConfigError(f"{path} is not a CIFAR-10 python tarball (member {name}: {exc}); re-download it") from None
    except pickle.UnpicklingError as exc:
        raise ConfigError(f"{path} member {name} was refused: {exc}; use the official tarball") from None
    if len(data) != len(labels):
        raise ConfigError(f"{path} member {name} has {len(data)} images but {len(labels)} labels; re-download it")
    if labels.size and (labels.min() < 0 or labels.max() >= CLASSES):
        raise ConfigError(f"{path} member {name} has labels outside 0-{CLASSES - 1}; re-download it")
    return data, labels


def _to_dataset(parts: list[tuple[np.ndarray, np.ndarray]]) -> TensorDataset:
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    images = torch.from_numpy(np.concatenate([p[0] for p in parts])).float().div_(255)
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return TensorDataset((images - mean) / std, labels)


def _check_md5(path: Path, expected: str | None) -> None:
    """data.md5 (the official tarball's: DataConfig.md5, config/schema.py); null skips the check."""
    actual = file_digest(path, "md5") if expected else None
    if expected and actual != expected:
        raise ConfigError(
            f"{path} has md5 {actual}, expected {expected}; the file is corrupt or tampered, re-download it"
        )


def _read_tarball(path: Path) -> tuple[list, list]:
    """(train, test) members as (images, labels) arrays, each read with the restricted unpickler."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            train = [_read_member(tar, name, path) for name in TRAIN_MEMBERS]
            test = [_read_member(tar, TEST_MEMBER, path)]
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise ConfigError(f"{path} cannot be read as a tar.gz ({exc}); re-download it") from None
    return train, test


def check_tarball(cfg: DictConfig, official_md5: str | None) -> None:
    """The parent's check of data.root's tarball, before any process starts: its md5, and unless it
    is the official file (data.md5 = official_md5, whose content the md5 vouches for) every member
    read as the ranks will read it (restricted unpickler, images and labels that match), so a damaged
    or foreign file is one line and exit 2 instead of a failed rank. A tarball still to be downloaded
    (data.download=true) is checked by the ranks."""
    path = tarball_path(cfg)
    if not path.is_file():
        return
    stat = path.stat()
    trusted = bool(cfg.md5) and cfg.md5 == official_md5
    _check_file(str(path.resolve()), stat.st_size, stat.st_mtime_ns, cfg.md5, trusted)


@functools.cache  # validate runs twice in the parent: a file unchanged since it passed is not read again
def _check_file(path: str, size: int, mtime_ns: int, md5: str | None, trusted: bool) -> None:
    _check_md5(Path(path), md5)
    if not trusted:
        _read_tarball(Path(path))


def load_cifar10(cfg: DictConfig) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets, after checking the tarball's md5 (``data.md5``; null skips it)."""
    path = tarball_path(cfg)
    if not path.is_file():
        if not cfg.download:
            raise ConfigError(f"data.root={cfg.root} has no {TARBALL}; put it there or add data.download=true")
        download(path)
    _check_md5(path, cfg.md5)  # again: the file may have changed since the parent checked it
    train, test = _read_tarball(path)
    return _to_dataset(train), _to_dataset(test)
