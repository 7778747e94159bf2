"""A tiny CIFAR-10 python tarball in the exact official format, for the loader and the bad-input tests."""

from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from parallel_lab.data.cifar10 import TEST_MEMBER, TRAIN_MEMBERS

PER_BATCH = 16


def _batch(rng, label: str) -> dict:
    # The official files are Python-2 pickles of dicts with byte-string keys.
    return {
        b"batch_label": label.encode(),
        b"labels": [int(v) for v in rng.integers(0, 10, PER_BATCH)],
        b"data": rng.integers(0, 256, (PER_BATCH, 3072), dtype=np.uint8),
        b"filenames": [f"img{i}.png".encode() for i in range(PER_BATCH)],
    }


def build_tarball(folder: Path, payloads: dict | None = None) -> Path:
    """folder/cifar-10-python.tar.gz with every member; payloads: member name -> raw bytes instead."""
    rng = np.random.default_rng(0)
    path = folder / "cifar-10-python.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in [*TRAIN_MEMBERS, TEST_MEMBER]:
            data = (payloads or {}).get(name) or pickle.dumps(_batch(rng, name), protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()
