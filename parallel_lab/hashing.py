"""File digests, read in 1 MiB blocks (CIFAR tarball md5, checkpoint sha256)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
