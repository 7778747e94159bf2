"""The real CIFAR-10 python tarball loader, on a tiny tarball built here in the exact format
(tests/support/cifar10_tarball.py); training on it end to end: tests/integration/test_cifar10.py."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from parallel_lab.data.cifar10 import TEST_MEMBER, TRAIN_MEMBERS, check_tarball, load_cifar10
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


# The parent's check (check_tarball, called by config/validate.py before any process starts).
OFFICIAL = "c58f30108f718f92721af3b95e74349a"  # cifar-10-python.tar.gz's md5 (DataConfig.md5)


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_parent_check_passes_a_good_tarball_with_or_without_md5(tmp_path):
    path = build_tarball(tmp_path)
    check_tarball(cfg_for(tmp_path, md5_of(path)), OFFICIAL)
    check_tarball(cfg_for(tmp_path, None), OFFICIAL)


@pytest.mark.parametrize(
    "damage, md5, message",
    [
        ("flip", "official", "md5"),  # the case: a damaged file, the default md5
        ("flip", None, "cifar-10-python.tar.gz .*(refused|re-download)"),  # no md5: the members are read
        ("truncate", None, "Compressed file ended.*re-download it"),
        ("member", "own", "not a CIFAR-10 python tarball"),
        ("labels", "own", "labels outside 0-9"),
        ("missing-test", "own", "test_batch"),
    ],
)
def test_parent_check_refuses_a_damaged_tarball(tmp_path, damage, md5, message):
    if damage == "member":
        path = build_tarball(tmp_path, {TRAIN_MEMBERS[2]: pickle.dumps({b"data": [1, 2, 3]}, protocol=2)})
    elif damage == "labels":
        bad = {b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [3, 10]}
        path = build_tarball(tmp_path, {TEST_MEMBER: pickle.dumps(bad, protocol=2)})
    elif damage == "missing-test":
        path = build_tarball(tmp_path)
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.name != TEST_MEMBER]
        with tarfile.open(path, "w:gz") as tar:
            for member, data in members:
                tar.addfile(member, io.BytesIO(data))
    else:
        path = build_tarball(tmp_path)
        _flip_middle(path) if damage == "flip" else path.write_bytes(path.read_bytes()[:300])
    expected = {"official": OFFICIAL, "own": md5_of(path), None: None}[md5]
    with pytest.raises(ConfigError, match=message):
        check_tarball(cfg_for(tmp_path, expected), OFFICIAL)


def test_parent_check_trusts_the_official_md5_and_reads_nothing_else(tmp_path):
    """The real file (its md5 is the official one) is not unpickled in the parent: the md5 vouches
    for its content, and the parent stays quick. A foreign file with its own md5 is read."""
    path = build_tarball(tmp_path, {TRAIN_MEMBERS[0]: pickle.dumps({b"data": Evil()}, protocol=2)})
    check_tarball(cfg_for(tmp_path, md5_of(path)), official_md5=md5_of(path))
    with pytest.raises(ConfigError, match="not allowed"):
        check_tarball(cfg_for(tmp_path, md5_of(path)), OFFICIAL)
