"""The real CIFAR-10 python tarball loader, on a tiny tarball built here in the exact format."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import load_metrics, run_cli
from omegaconf import OmegaConf

from parallel_lab.data.cifar10 import TEST_MEMBER, TRAIN_MEMBERS, load_cifar10
from parallel_lab.errors import ConfigError

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


def cfg_for(root: Path, md5: str | None):
    return OmegaConf.create({"name": "cifar10", "root": str(root), "download": False, "md5": md5})


def test_loader_reads_the_tarball(tmp_path):
    path = build_tarball(tmp_path)
    train, test = load_cifar10(cfg_for(tmp_path, md5_of(path)))
    assert train.tensors[0].shape == (5 * PER_BATCH, 3, 32, 32) and test.tensors[0].shape == (PER_BATCH, 3, 32, 32)
    # Pixel (0,0) of the red plane of the first image round-trips through the normalisation.
    raw = pickle.loads(tarfile.open(path).extractfile(TRAIN_MEMBERS[0]).read(), encoding="bytes")
    expected = (raw[b"data"][0, 0] / 255 - 0.4914) / 0.2470
    assert float(train.tensors[0][0, 0, 0, 0]) == pytest.approx(expected, rel=1e-5)
    assert train.tensors[1][:PER_BATCH].tolist() == raw[b"labels"]


def test_bad_md5_is_refused(tmp_path):
    build_tarball(tmp_path)
    with pytest.raises(ConfigError, match="md5"):
        load_cifar10(cfg_for(tmp_path, "0" * 32))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_disallowed_global_is_refused(tmp_path):
    path = build_tarball(tmp_path, {TRAIN_MEMBERS[0]: pickle.dumps({b"data": Evil()}, protocol=2)})
    with pytest.raises(ConfigError, match="posix.system|os.system|not allowed"):
        load_cifar10(cfg_for(tmp_path, md5_of(path)))


def test_training_on_the_tarball_end_to_end(tmp_path):
    path = build_tarball(tmp_path)
    run_cli(
        tmp_path / "run",
        "strategy=ddp",
        "data=cifar10",
        f"data.root={tmp_path}",
        f"data.md5={md5_of(path)}",
        "trainer.steps=2",
        "trainer.global_batch=16",
    )
    metrics = load_metrics(tmp_path / "run")
    assert metrics["data"] == "cifar10" and len(metrics["losses"]) == 2
