"""Checkpoint files, in one process: a planted pickle in a DCP or DeepSpeed file does not run, good
DCP files still load, and a damaged checkpoint is refused with the reason. Kills, restarts and
resumes on real ranks: tests/integration/test_checkpoint.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from parallel_lab.checkpoint import COMPLETE, CheckpointError, checkpoint_name, read_manifest, sha256_file
from tests.support.pickles import Planted

NO_PROCESS_GROUP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose


@NO_PROCESS_GROUP
@pytest.mark.parametrize("where", ["metadata", "byte entry"])
def test_planted_pickle_in_dcp_files_does_not_run(tmp_path, where):
    import torch.distributed.checkpoint as dcp

    from parallel_lab.checkpoint.dcp_reader import load_sharded

    marker = tmp_path / "pwned"
    lr = Planted(marker) if where == "byte entry" else 0.1
    dcp.save({"w": torch.arange(4.0), "lr": lr}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    if where == "metadata":
        (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError, match="is not allowed in a checkpoint's .metadata|Weights only load failed"):
        load_sharded({"w": torch.zeros(4), "lr": 0.0}, str(tmp_path / "dcp"))
    assert not marker.exists()


@NO_PROCESS_GROUP
def test_dcp_loader_still_reads_good_files(tmp_path):
    import torch.distributed.checkpoint as dcp

    from parallel_lab.checkpoint.dcp_reader import load_sharded

    dcp.save({"w": torch.arange(4.0), "lr": 0.1, "betas": (0.9, 0.999)}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"w": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0)}
    load_sharded(state, str(tmp_path))
    assert torch.equal(state["w"], torch.arange(4.0)) and state["lr"] == 0.1 and tuple(state["betas"]) == (0.9, 0.999)


def test_planted_pickle_in_a_deepspeed_file_does_not_run(tmp_path):
    pytest.importorskip("deepspeed", reason="the DeepSpeed checkpoint reader needs deepspeed; `make test` installs it")
    from parallel_lab.checkpoint.ds_reader import weights_only_load

    marker = tmp_path / "pwned"
    torch.save({"optimizer_state_dict": Planted(marker)}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(pickle.UnpicklingError):
        weights_only_load(str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert not marker.exists()


# ----- the integrity check itself -----


def _fake_checkpoint(root: Path, step: int) -> Path:
    folder = root / checkpoint_name(step)
    folder.mkdir(parents=True)
    torch.save({"w": torch.arange(10.0)}, folder / "model_optimizer.pt")
    files = {
        "model_optimizer.pt": {
            "size": (folder / "model_optimizer.pt").stat().st_size,
            "sha256": sha256_file(folder / "model_optimizer.pt"),
        }
    }
    (folder / COMPLETE).write_text(json.dumps({"format": 1, "step": step, "run": {}, "files": files}))
    return folder


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "model_optimizer.pt").write_bytes((f / "model_optimizer.pt").read_bytes()[:-7]), "bytes"),
        (
            lambda f: (f / "model_optimizer.pt").write_bytes(b"x" + (f / "model_optimizer.pt").read_bytes()[1:]),
            "sha256",
        ),
        (lambda f: (f / COMPLETE).unlink(), "incomplete"),
        (lambda f: (f / COMPLETE).write_text("{not json"), "corrupt"),
        (lambda f: (f / "model_optimizer.pt").unlink(), "missing"),
    ],
)
def test_damaged_checkpoint_is_refused_with_the_reason(tmp_path, damage, message):
    folder = _fake_checkpoint(tmp_path, 2)
    assert read_manifest(folder)["step"] == 2
    damage(folder)
    with pytest.raises(CheckpointError, match=message):
        read_manifest(folder)
