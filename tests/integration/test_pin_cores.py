"""trainer.pin_cores (config/resources.py ``pin_to_cores``): each rank of a CPU run bound to its own
cores, read back from where the ranks say they ran (metrics.json ``ranks[k].cores``, the kernel's
affinity of each rank's process). The same run without it is the control: every rank may use every
core, so the check below could not pass by accident."""

from __future__ import annotations

import pytest

from parallel_lab.cli.run import load_metrics
from parallel_lab.config.resources import allowed_cores
from tests.support.cli import run_cli

RUN = ("strategy=ddp", "world_size=2", "trainer.steps=3", "trainer.eval_batches=0")


def _cores(run_dir) -> list[list[int]]:
    return [r["cores"] for r in sorted(load_metrics(run_dir)["ranks"], key=lambda r: r["rank"])]


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="two ranks need two cores to be bound apart")
def test_each_rank_runs_on_its_own_core_only_when_asked(tmp_path):
    allowed = allowed_cores()
    run_cli(tmp_path / "pinned", *RUN, "trainer.pin_cores=true", timeout=120)
    assert _cores(tmp_path / "pinned") == [[allowed[0]], [allowed[1]]]
    run_cli(tmp_path / "free", *RUN, timeout=120)
    assert _cores(tmp_path / "free") == [allowed, allowed]
