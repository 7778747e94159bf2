"""The real CIFAR-10 python tarball loader, on a tiny tarball built here in the exact format
(tests/support/cifar10_tarball.py); training on it end to end: tests/integration/test_cifar10.py."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from parallel_lab.data.cifar10 import TRAIN_MEMBERS, load_cifar10
from parallel_lab.errors import ConfigError
from tests.support.cifar10_tarball import PER_BATCH, build_tarball, md5_of
from tests.support.pickles import Evil


def cfg_for(root: Path, md5: str | None):
    return OmegaConf.create({"name": "cifar10", "root": str(root), "download": False, "md5": md5})


@pytest.mark.floats  # a normalised pixel to 1e-5
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


def test_pickle_with_disallowed_global_is_refused(tmp_path):
    path = build_tarball(tmp_path, {TRAIN_MEMBERS[0]: pickle.dumps({b"data": Evil()}, protocol=2)})
    with pytest.raises(ConfigError, match="posix.system|os.system|not allowed"):
        load_cifar10(cfg_for(tmp_path, md5_of(path)))
