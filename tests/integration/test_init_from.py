"""trainer.init_from=<path> (checkpoint/outside.py): a new run (steps from 0, data from its start)
from outside weights, and with trainer.init_optimizer=true Adam's state, written by the real
libraries with no code of ours (tests/support/outside.py, tests/support/deepspeed_writer.py).

Same training: a plain torch loop that loads the same file and trains the same steps; the run under
a strategy must agree with it (losses to 1e-5, parameters to 1e-5 relative): what the loop does with
the file is what the strategy did. Without init_optimizer the same comparison fails (Adam's moments
matter), which shows the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.checks import assert_losses_close
from tests.support.outside import plain_adam

COMMON = ("trainer.global_batch=32", "data.size=96", "trainer.eval_batches=0", "dist_timeout_s=60")
WRITTEN_STEPS, STEPS = 2, 2


@pytest.fixture(scope="module")
def written():
    """A plain torch loop's state after 2 steps, as one dict (model and optimizer state_dicts)."""
    _, net, opt = plain_adam(WRITTEN_STEPS)
    return {"model": net.state_dict(), "optimizer": opt.state_dict()}


def expected(written: dict, with_optimizer: bool):
    init = written if with_optimizer else {"model": written["model"]}
    losses, net, _ = plain_adam(STEPS, init)
    return losses, {n: p.detach() for n, p in net.named_parameters()}


def assert_same(metrics: dict, want) -> None:
    from pathlib import Path

    from parallel_lab.protocol import load_final_params

    losses, params = want
    assert_losses_close(metrics["losses"], losses, rtol=1e-5)
    got = load_final_params(Path(metrics["run_dir"]))
    for name, value in params.items():
        rel = (got[name] - value).norm() / value.norm()
        assert rel < 1e-5, f"{name}: relative difference {rel:.2g}"


@pytest.mark.floats  # losses and weights to 1e-5 of a plain loop
def test_torch_save_into_zero3(cli, tmp_path, written):
    """torch.save({"model", "optimizer"}) continued under zero3@2 with Adam's state."""
    torch.save(written, tmp_path / "plain.pt")
    metrics = cli(
        "strategy=zero3",
        "world_size=2",
        *COMMON,
        f"trainer.steps={STEPS}",
        f"trainer.init_from={tmp_path / 'plain.pt'}",
        "trainer.init_optimizer=true",
    )
    assert metrics["initialized_from"]["format"] == "torch" and metrics["initialized_from"]["optimizer"]
    assert_same(metrics, expected(written, True))
    with pytest.raises(AssertionError):  # the check can fail: Adam restarted is another training
        assert_same(metrics, expected(written, False))


# ----- make test-all: every outside format, each continued under two strategies -----
def _write(kind: str, written: dict, folder) -> str:
    """The state after 2 plain steps, written by the real library alone; returns init_from's path."""
    import os
    import subprocess
    import sys

    from tests.support.cli import ROOT

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "torch":
        torch.save(written, folder / "plain.pt")
        return str(folder / "plain.pt")
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(written["model"], folder / "model.safetensors")
        return str(folder / "model.safetensors")
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": written["model"], "optimizer": written["optimizer"]}, checkpoint_id=str(folder / "dcp"))
        return str(folder / "dcp")
    stage, world = (int(x) for x in kind.removeprefix("deepspeed").split("@"))
    script = ROOT / "tests" / "support" / "deepspeed_writer.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    # The script imports tests.support.reference: the checkout's root on the path, as pytest has it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [*cmd, str(script), str(stage), str(folder / "ds")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return str(folder / "ds")


FORMATS = {  # kind: (with Adam state, two targets)
    "torch": (True, (("strategy=tp", "world_size=2"), ("strategy=ddp", "world_size=1"))),
    "safetensors": (False, (("strategy=fsdp", "world_size=2"), ("strategy=pp", "world_size=2"))),
    "dcp": (True, (("strategy=zero1", "world_size=2"), ("strategy=tp", "world_size=2"))),
    "deepspeed0@2": (True, (("strategy=single",), ("strategy=zero3", "world_size=2"))),
    "deepspeed1@2": (True, (("strategy=fsdp", "world_size=2"), ("strategy=manual_ddp", "world_size=2"))),
    "deepspeed2@1": (True, (("strategy=zero2", "world_size=2"), ("strategy=pp", "world_size=2"))),
    "deepspeed3@2": (True, (("strategy=zero0", "world_size=1"), ("strategy=fsdp", "world_size=2"))),
}


@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.parametrize("kind", list(FORMATS))
def test_outside_checkpoints_continue_under_two_strategies(cli, tmp_path, written, kind):
    with_optimizer, targets = FORMATS[kind]
    path = _write(kind, written, tmp_path / "written")
    for overrides in targets:
        metrics = cli(
            *overrides,
            *COMMON,
            f"trainer.steps={STEPS}",
            f"trainer.init_from={path}",
            f"trainer.init_optimizer={str(with_optimizer).lower()}",
        )
        assert metrics["initialized_from"]["format"] == kind.split("@")[0].rstrip("0123")
        assert_same(metrics, expected(written, with_optimizer))


@pytest.mark.slow
@pytest.mark.extra
def test_our_checkpoint_starts_a_new_run(cli, tmp_path, written):
    """One of our checkpoints (zero3@2, 2 steps: the same training as the plain loop's) starts a
    new run under ddp@2 and single: steps and data from 0, Adam's state carried on."""
    source = cli("strategy=zero3", "world_size=2", *COMMON, "trainer.steps=2", "trainer.checkpoint_every=2")
    from pathlib import Path

    from parallel_lab.checkpoint import checkpoint_name

    path = Path(source["run_dir"]) / "checkpoints" / checkpoint_name(2)
    for overrides in (("strategy=ddp", "world_size=2"), ("strategy=single",)):
        metrics = cli(
            *overrides, *COMMON, "trainer.steps=2", f"trainer.init_from={path}", "trainer.init_optimizer=true"
        )
        assert metrics["initialized_from"]["format"] == "parallel_lab" and metrics.get("resumed_from") is None
        assert_same(metrics, expected(written, True))
