"""Checkpoint, resume and torchrun restarts: a killed run finishes with bitwise the same weights.

Each strategy trains 6 steps straight (no checkpoints, all in one set of ranks), then again under torchrun with
--max-restarts=1, checkpointing every 2 steps, while one rank SIGKILLs itself (a lost node) after a
checkpoint. torchrun restarts the group, the workers resume from the newest complete checkpoint
and finish. The data set holds 3 batches, so the 6 steps cross an epoch boundary and the resumed
sampler position is exercised both mid-epoch and at an epoch start. The loaders' integrity and
safety checks in one process: tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel_lab.checkpoint import COMPLETE, checkpoint_name, sha256_file
from parallel_lab.cli.run import load_metrics, run_ranks
from tests.support.bodies.runs import train_and_record
from tests.support.cli import run_cli, write_config
from tests.support.pickles import Planted

COMMON = ("trainer.steps=6", "trainer.global_batch=32", "data.size=96", "trainer.eval_batches=0", "dist_timeout_s=60")
TIMEOUT = 300


# The uninterrupted runs the make-test cases compare with, trained in one set of ranks.
STRAIGHT_IN_MAKE_TEST = [("ddp",), ("fsdp",), ("zero3",), ("tp",)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 6-step run of each strategy (+ options), computed once per module, through
    the worker's own steps in one set of ranks (tests/support/bodies/runs.py): the first call trains
    every STRAIGHT_IN_MAKE_TEST run, another key (make test-all) trains on demand."""
    cache: dict[tuple, dict] = {}
    root = tmp_path_factory.mktemp("straight")

    def train(keys: list[tuple]) -> None:
        paths = []
        for strategy, *options in keys:
            name = "_".join((strategy, *options)).replace("=", "-")
            paths.append(write_config(root / f"{name}.yaml", f"strategy={strategy}", *options, *COMMON))
        run_ranks(train_and_record, world_size=2, timeout=TIMEOUT, config_paths=paths)
        cache.update({key: load_metrics(Path(path).with_suffix("")) for key, path in zip(keys, paths)})

    def get(strategy: str, *options: str) -> dict:
        key = (strategy, *options)
        if key not in cache:
            train(STRAIGHT_IN_MAKE_TEST if not cache and key in STRAIGHT_IN_MAKE_TEST else [key])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def ddp_checkpoints(tmp_path_factory):
    """checkpoints(tmp): a fresh copy, under tmp, of the checkpoints folder (steps 2 and 4) of a
    4-step ddp run; the run itself happens once per module."""
    source = tmp_path_factory.mktemp("ddp_checkpoints")
    run_cli(source, "strategy=ddp", *COMMON, "trainer.steps=4", "trainer.checkpoint_every=2", timeout=TIMEOUT)

    def copy(tmp: Path) -> Path:
        return Path(shutil.copytree(source / "checkpoints", tmp / "checkpoints"))

    return copy


def _assert_same_training(resumed: dict, straight: dict, resume_step: int) -> None:
    assert resumed["resumed_from_step"] == resume_step
    assert resumed["final_param_sha256"] == straight["final_param_sha256"], "final weights differ bitwise"
    # The steps trained after the resume, compared bitwise; the earlier ones come from the checkpoint.
    assert resumed["losses"][resume_step:] == straight["losses"][resume_step:]
    assert resumed["losses"] == straight["losses"]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize(
    "strategy, kill_rank, kill_before_step",
    # make test-all. make test keeps both halves of the claim apart, each cheaper: torchrun
    # restarting killed workers that resume bitwise (ddp: the kill-during-write test below), and
    # each format resuming bitwise (test_resume_from_a_named_checkpoint: DeepSpeed's zero3, DCP,
    # tp's shards).
    [
        pytest.param("ddp", 1, 3, marks=pytest.mark.extra),
        pytest.param("fsdp", 1, 5, marks=pytest.mark.extra),
        pytest.param("zero3", 1, 5, marks=pytest.mark.extra),
        pytest.param("manual_ddp", 0, 5, marks=pytest.mark.extra),
        pytest.param("zero2", 0, 3, marks=pytest.mark.extra),
    ],
)
def test_killed_rank_torchrun_restart_resumes_bitwise(tmp_path, straight, strategy, kill_rank, kill_before_step):
    run_cli(
        tmp_path,
        f"strategy={strategy}",
        *COMMON,
        "launcher=torchrun",
        "launcher.max_restarts=1",
        "trainer.checkpoint_every=2",
        f"fault.rank={kill_rank}",
        f"fault.step={kill_before_step}",
        "fault.mode=kill",
        timeout=TIMEOUT,
    )
    metrics = load_metrics(tmp_path)
    assert metrics["attempt"] == 1, "torchrun did not restart the workers"
    _assert_same_training(metrics, straight(strategy), resume_step=kill_before_step // 2 * 2)
    assert _checkpoints(tmp_path) == [checkpoint_name(4), checkpoint_name(6)]  # keep_checkpoints=2, no .tmp


def test_kill_during_checkpoint_write_resumes_from_the_previous_one(tmp_path, straight):
    # Rank 1 dies after writing its part of the step-4 checkpoint, before it is committed.
    run_cli(
        tmp_path,
        "strategy=ddp",
        *COMMON,
        "launcher=torchrun",
        "launcher.max_restarts=1",
        "trainer.checkpoint_every=2",
        "fault.rank=1",
        "fault.step=4",
        "fault.at=checkpoint",
        "fault.mode=kill",
        timeout=TIMEOUT,
    )
    metrics = load_metrics(tmp_path)
    assert metrics["attempt"] == 1
    # Also make test's proof that another launcher trains as spawn does (test_spine.py's torchrun
    # case, extra): torchrun started fresh interpreters, the straight run's ranks were forked from
    # the zygote, and the weights are the same to the last bit.
    assert (metrics["launcher"], metrics["rank_start"]) == ("torchrun", "exec")
    _assert_same_training(metrics, straight("ddp"), resume_step=2)
    assert _checkpoints(tmp_path) == [checkpoint_name(4), checkpoint_name(6)]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, straight, ddp_checkpoints):
    checkpoints = ddp_checkpoints(tmp_path)
    newest = checkpoints / checkpoint_name(4)
    weights = newest / "model_optimizer.pt"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a full disk

    second = tmp_path / "second"
    result = run_cli(second, "strategy=ddp", *COMMON, f"trainer.checkpoint_dir={checkpoints}", timeout=TIMEOUT)
    assert "skipping checkpoint" in result.stderr and "corrupt" in result.stderr, result.stderr[-2000:]
    _assert_same_training(load_metrics(second), straight("ddp"), resume_step=2)


@pytest.mark.parametrize(
    "strategy, options, files",
    [
        ("tp", [], ["shard_rank0.pt", "shard_rank1.pt"]),  # each rank its own part
        ("fsdp", [], ["dcp/__0_0.distcp", "dcp/__1_0.distcp"]),  # DCP: a file per rank
        (  # DeepSpeed's own files: each rank its optimizer partition
            "zero3",
            [],
            [
                "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            ],
        ),
        pytest.param("pp", [], ["shard_rank0.pt", "shard_rank1.pt"], marks=pytest.mark.extra),
        pytest.param(
            "fsdp",
            ["strategy.version=1"],
            ["dcp/__0_0.distcp", "dcp/__1_0.distcp"],  # DCP: a file per rank
            marks=pytest.mark.extra,
        ),
        pytest.param(
            "zero1",
            [],
            [
                "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            ],
            marks=pytest.mark.extra,
        ),
    ],
)
def test_resume_from_a_named_checkpoint(tmp_path, straight, strategy, options, files):
    first = tmp_path / "first"
    run_cli(
        first,
        f"strategy={strategy}",
        *options,
        *COMMON,
        "trainer.steps=3",
        "trainer.checkpoint_every=3",
        timeout=TIMEOUT,
    )
    folder = first / "checkpoints" / checkpoint_name(3)
    assert set(files) <= set(json.loads((folder / COMPLETE).read_text())["files"])
    second = tmp_path / "second"
    run_cli(second, f"strategy={strategy}", *options, *COMMON, f"trainer.resume={folder}", timeout=TIMEOUT)
    _assert_same_training(load_metrics(second), straight(strategy, *options), resume_step=3)


@pytest.mark.extra  # make test: a torchrun restart after a kill resumes from the right checkpoint (above)
def test_restart_after_resuming_from_a_path_uses_the_newer_checkpoint(tmp_path, straight, ddp_checkpoints):
    checkpoints = ddp_checkpoints(tmp_path)
    second = tmp_path / "second"
    # Resumes from the step-2 checkpoint, checkpoints step 4 itself, loses rank 1 before step 5: the
    # restart must continue from its own step 4, not go back to the step-2 checkpoint it was given.
    run_cli(
        second,
        "strategy=ddp",
        *COMMON,
        f"trainer.resume={checkpoints / checkpoint_name(2)}",
        "trainer.checkpoint_every=2",
        "launcher=torchrun",
        "launcher.max_restarts=1",
        "fault.rank=1",
        "fault.step=5",
        "fault.mode=kill",
        timeout=TIMEOUT,
    )
    metrics = load_metrics(second)
    assert metrics["attempt"] == 1
    _assert_same_training(metrics, straight("ddp"), resume_step=4)


def _rehash(folder: Path) -> None:
    """Rewrite complete.json for the tampered files, as an attacker would."""
    manifest = json.loads((folder / COMPLETE).read_text())
    for rel in manifest["files"]:
        manifest["files"][rel] = {"size": (folder / rel).stat().st_size, "sha256": sha256_file(folder / rel)}
    (folder / COMPLETE).write_text(json.dumps(manifest))


def test_planted_pickle_in_a_checkpoint_does_not_run(tmp_path, ddp_checkpoints):
    folder = ddp_checkpoints(tmp_path) / checkpoint_name(2)
    marker = tmp_path / "pwned"
    torch.save({"model": Planted(marker), "optimizer": {}}, folder / "model_optimizer.pt")
    _rehash(folder)
    result = run_cli(
        tmp_path / "second", "strategy=ddp", *COMMON, f"trainer.resume={folder}", check=False, timeout=TIMEOUT
    )
    assert result.returncode != 0 and not marker.exists()
    assert "Weights only load failed" in result.stderr.strip().splitlines()[-1]
