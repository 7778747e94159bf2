"""BatchNorm across strategies (docs/batchnorm.md): model.norm=group keeps today's models bit for
bit; plain BatchNorm under data parallelism is another training ("differs by design"), SyncBatchNorm
matches single by the parity criterion; running statistics are identical across replicas, counted
in memory, communication and the planner, and come back bitwise from a checkpoint. Every key test
is shown failing on a deliberately broken variant (tests/support/bodies/batchnorm.py BROKEN)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.cli.run import run_ranks
from parallel_lab.config import compose_config, validate
from parallel_lab.errors import ConfigError
from parallel_lab.models import build_model
from parallel_lab.protocol import load_final_params
from tests.support.bodies.batchnorm import checkpoint_round_trip, sync_matches_full_batch, train_runs
from tests.support.cli import assert_one_clean_line, run_cli, write_config
from tests.support.models_before_norm import build_model_before_norm
from tests.support.reference import parity_reference

# The default (GroupNorm / no-norm) models the test rebuilds the pre-model.norm way (name, width).
GROUP_MODELS = [("resnet18", 0.5), ("cnn", 1.0)]
STEPS, BATCH = 5, 32  # plain BatchNorm departs from single at the first forward: a few steps show it


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.floats
@pytest.mark.parametrize("name,width", GROUP_MODELS)
def test_group_norm_models_are_built_bit_for_bit_as_before(name, width):
    """Today's default model has the bits the construction before model.norm draws on this machine
    (tests/support/models_before_norm.py; not a digest recorded on one CPU: docs/testing.md)."""
    before = _digest(build_model_before_norm(name, 10, width, seed=0))
    cfg = OmegaConf.create({"name": name, "num_classes": 10, "width": width})
    assert _digest(build_model(cfg, 0)) == before  # no norm key: the default
    assert _digest(build_model(OmegaConf.merge(cfg, {"norm": "group"}), 0)) == before
    batch = build_model(OmegaConf.merge(cfg, {"norm": "batch"}), 0)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in batch.modules())


@pytest.mark.floats  # tolerances against plain BatchNorm on the whole batch
def test_cpu_sync_batchnorm_is_batchnorm_over_the_whole_batch():
    run_ranks(sync_matches_full_batch, world_size=2, timeout=120)


def _last_line(outputs: list[str]):
    """Rank 0's JSON result: the last line of its stdout (DeepSpeed prints before it)."""
    return json.loads(outputs[0].strip().splitlines()[-1])


def _config(tmp_path: Path, name: str, *overrides: str) -> str:
    return write_config(
        tmp_path / f"{name}.yaml",
        "model=cnn",
        "world_size=2",
        f"trainer.steps={STEPS}",
        f"trainer.global_batch={BATCH}",
        "trainer.eval_batches=1",
        *overrides,
    )


@pytest.mark.floats  # parity verdicts against the reference
def test_syncbatch_matches_single_and_plain_batchnorm_differs_by_design(tmp_path):
    """ddp with SyncBatchNorm is single's training; with plain BatchNorm (16 samples a rank) it is
    not, far beyond the envelope; syncbatch left unconverted (broken) fails like plain batch."""
    runs = {
        "sync": [_config(tmp_path, "sync", "strategy=ddp", "model.norm=syncbatch"), ""],
        "batch": [_config(tmp_path, "batch", "strategy=manual_ddp", "model.norm=batch"), ""],
        "unconverted": [_config(tmp_path, "unconverted", "strategy=ddp", "model.norm=syncbatch"), "not_converted"],
        "no_stats_sync": [_config(tmp_path, "nosync", "strategy=manual_ddp", "model.norm=batch"), "no_stats_sync"],
    }
    out = _last_line(run_ranks(train_runs, 2, timeout=300, runs=list(runs.values())))
    res = dict(zip(runs, out))
    ref = parity_reference("cnn", steps=STEPS, global_batch=BATCH, norm="batch")
    params = {k: load_final_params(Path(r["run_dir"])) for k, r in res.items()}
    verdict = {k: ref.verdict(r["losses"], params[k], k, expect_pass=k == "sync") for k, r in res.items()}
    assert verdict["sync"].passed, verdict["sync"].reason()
    for broken in ("batch", "unconverted"):
        assert not verdict[broken].passed and verdict[broken].early_dloss.ratio > 100, verdict[broken].as_dict()
    sync, batch = res["sync"]["batchnorm"], res["batch"]["batchnorm"]
    assert sync["samples"] == [BATCH] and batch["samples"] == [BATCH // 2]
    assert sync["comm_bytes_per_step"] == sync["comm_theory_bytes_per_step"] > 0  # SyncBatchNorm's collectives
    assert batch["comm_bytes_per_step"] == batch["comm_theory_bytes_per_step"] > 0  # the running-stat broadcast
    assert res["unconverted"]["batchnorm"]["samples"] == [BATCH // 2]
    # running statistics identical across the replicas: the real strategies yes, the broken one no
    assert sync["running_stats_identical"] and batch["running_stats_identical"]
    assert not res["no_stats_sync"]["batchnorm"]["running_stats_identical"]
    for rank in res["sync"]["ranks"]:  # buffers measured = the planner's prediction
        assert rank["buffer_bytes"] == rank["predicted_buffer_bytes"] > 0


def test_checkpoint_restores_running_statistics_bitwise(tmp_path):
    path = _config(tmp_path, "ckpt", "strategy=ddp", "model.norm=batch", "trainer.steps=2", "trainer.eval_batches=0")
    body = checkpoint_round_trip
    assert _last_line(run_ranks(body, 2, timeout=300, config_path=path)) == []
    differ = _last_line(run_ranks(body, 2, timeout=300, config_path=path, broken="drops_buffers"))
    assert differ and all("running" in k or "num_batches" in k for k in differ), differ


@pytest.mark.extra
@pytest.mark.parametrize(
    "strategy", ["manual_ddp", "fsdp", "zero1", "zero3", "tp", "pp"], ids=lambda s: s.replace("=", "")
)
def test_every_checkpoint_format_restores_running_statistics_bitwise(tmp_path, strategy):
    extra = {"pp": ["strategy.microbatches=2"], "tp": []}.get(strategy, [])
    path = _config(tmp_path, "ckpt", f"strategy={strategy}", "model.norm=batch", "trainer.steps=2", *extra)
    assert _last_line(run_ranks(checkpoint_round_trip, 2, 300, config_path=path)) == []


REFUSED = {  # overrides -> text the one line must hold
    ("strategy=pp", "model.norm=syncbatch"): "strategy=pp",
    ("strategy=tp", "model.norm=syncbatch"): "strategy=tp",
    ("strategy=dp", "model.norm=syncbatch"): "strategy=dp",
    ("strategy=tp", "model.norm=batch", "strategy.split_conv=true"): "split_conv",
}


@pytest.mark.parametrize("overrides", list(REFUSED), ids=lambda o: " ".join(o))
def test_norm_a_strategy_cannot_apply_is_refused_in_one_line(overrides):
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=cnn", *overrides]))
    assert REFUSED[overrides] in str(info.value) and "model.norm" in str(info.value) and "; " in str(info.value)


def test_unknown_norm_and_refused_syncbatch_exit_2_before_any_worker(tmp_path):
    for i, (overrides, named) in enumerate(
        [(("model.norm=layer",), "layer"), (("strategy=pp", "model.norm=syncbatch"), "model.norm=syncbatch")]
    ):
        run_dir = tmp_path / f"run{i}"
        result = run_cli(run_dir, *overrides, check=False, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert_one_clean_line(result, run_dir, named)
        assert not (run_dir / "metrics.json").exists()
