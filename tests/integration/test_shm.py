"""The shared-memory transport under the hand-written ring (parallel_lab.comm.shm), on real gloo
ranks of this host: all_reduce, reduce_scatter and all_gather over shm equal a reference computed in
the test body and the gloo (p2p) path's bits, at world 2 and 3, float32 and int64, sizes not
divisible by the world size and bigger than a slot; a deliberately broken publish is caught; a rank
that dies or stalls mid-collective makes its peers raise within the timeout; ranks on two "hosts"
fall back to gloo; nothing is left in /dev/shm. The collectives against torch.distributed (now over
shm on one host, and over gloo with PARALLEL_LAB_HAND_TRANSPORT=p2p): test_collectives.py."""

import os
import re
from pathlib import Path

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.comm import shm
from tests.support.bodies.shm import check_against_p2p, check_broken, check_dead_peer, check_fallback


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def orphans() -> set[str]:
    """This transport's files in /dev/shm whose creator (the pid in the name) no longer runs. A running
    creator's file is in use: make test runs two test processes side by side, and the other one's
    ranks may have theirs open while this test ends."""
    files = [f for f in os.listdir(shm.SHM_DIR) if f.startswith(shm.PREFIX)]
    return {f for f in files if not _running(int(f[len(shm.PREFIX) :].split("_")[0]))}


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test: the files this transport creates in /dev/shm are gone once their ranks are."""
    before = orphans()
    yield
    left = orphans() - before
    assert not left, f"left in {shm.SHM_DIR}: {sorted(left)}"


@pytest.mark.floats  # reductions to 1e-5 of a reference, bits of p2p
@pytest.mark.parametrize("world_size", [2, 3])
def test_shm_matches_reference_and_p2p_bits(world_size):
    outputs = run_ranks(check_against_p2p, world_size=world_size, timeout=120)
    assert all(out.startswith("checked 32 over shm") for out in outputs), outputs


@pytest.mark.parametrize("variant", ["publish_before_data", "skip_consumed_wait"])
def test_broken_publish_is_caught(variant):
    outputs = run_ranks(check_broken, world_size=2, timeout=60, variant=variant)
    assert all("correct: ok" in out for out in outputs), outputs
    found = [re.search(r"broken: (.*)", out).group(1) for out in outputs]
    assert any(f != "not detected" for f in found), f"{variant} went unnoticed: {outputs}"


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_dead_peer_raises_instead_of_hanging(how):
    timeout_s = 1.0
    outputs = run_ranks(check_dead_peer, world_size=2, timeout=60, env={shm.TIMEOUT_ENV: str(timeout_s)}, how=how)
    line = outputs[0].strip()
    match = re.match(r"raised after ([0-9.]+) s: (.*)", line)
    assert match, outputs
    assert "rank 1" in match.group(2), line
    if how == "exit":  # seen gone at the next liveness check, well before the timeout
        assert "exited" in match.group(2) and float(match.group(1)) < timeout_s, line
    else:
        assert "waited" in match.group(2) and timeout_s <= float(match.group(1)) < timeout_s + 0.5, line


def test_two_hosts_fall_back_to_gloo():
    outputs = run_ranks(check_fallback, world_size=2, timeout=60)
    assert all(out.startswith("fell back: p2p") for out in outputs), outputs
