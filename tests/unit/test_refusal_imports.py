"""Bad input is refused before torch (or DeepSpeed) is imported, in well under 2 s: the refusals of
the bad-input catalogue (tests/integration/test_failures.py) run through the real command line,
each in a process forked from one that imported only what ``python -m parallel_lab`` imports before
reading its arguments (tests/support/refusal_driver.py), and each child reports whether torch got
loaded on its way to exit 2. A rule that imports torch at module level (a strategy's rules module,
the models', data or checkpoint package roots) fails here. ``make test`` runs one refusal from
every place one comes from; the whole catalogue runs under ``extra``. Each prints its slowest
refusal in CPU seconds: the command line's start (timed once) plus the child's."""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest

from tests.integration.test_failures import CATALOGUE
from tests.support.cli import ROOT

# One refusal from every place one comes from: Hydra's typed keys, the ranges, each strategy's
# rules, the model, data, checkpoint, launcher and host checks.
IN_MAKE_TEST = (
    "unknown-key",
    "wrong-type-int",
    "unknown-strategy",
    "lr-nan",
    "precision-bf16-on-tp-dtensor",
    "tp-dp-degree",
    "pp-microbatches",
    "fsdp-hybrid",
    "zero-stage-5",
    "manual-ddp-mpi-spawn",
    "ddp-bucket",
    "model-width-0",
    "cifar-missing-tarball",
    "resume-missing",
    "min-nodes-no-checkpoints",
    "hosts-repeated",
    "batch-not-divisible",
)
STATIC = [case for case, (overrides, _) in CATALOGUE.items() if not callable(overrides)]
PLAN = "parallel_lab.plan"
# The planner's command line (``python -m parallel_lab.plan``): its bad inputs, each with what its one
# line must name. It composes, checks the size and the split, then builds meta models (torch).
PLAN_CATALOGUE = {
    "plan-unknown-key": (["trainer.stesp=3"], "stesp"),
    "plan-unknown-strategy": (["strategy=zero5"], "zero5"),
    "plan-device-memory": (["plan.device_memory=lots"], "plan.device_memory=lots"),
    "plan-model-width": (["model.width=-2"], "model.width=-2"),
    "plan-tp-degree": (["strategy=tp", "strategy.tp=3", "world_size=3"], "strategy.tp=3"),
    "plan-pp-stages": (["strategy=pp", "world_size=6", "strategy.stages=6"], "strategy.stages=6"),
    "plan-recommend-device-memory": (["plan.recommend=true", "plan.device_memory=0"], "plan.device_memory=0"),
    "plan-unknown-hardware": (["plan.hardware=a100_81g"], "a100_81g"),
}


def refuse(cases: list[str], tmp_path) -> tuple[float, float, dict[str, dict]]:
    """(the command line's start in seconds of wall and of CPU, case -> its child's result)."""
    argv = [
        [case, [f"plan.out={tmp_path / case}", *PLAN_CATALOGUE[case][0]], PLAN]
        if case in PLAN_CATALOGUE
        else [case, [f"hydra.run.dir={tmp_path / case}", *CATALOGUE[case][0]]]
        for case in cases
    ]
    driver = subprocess.run(
        [sys.executable, "-m", "tests.support.refusal_driver"],
        input=json.dumps(argv),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert driver.returncode == 0, driver.stderr[-3000:]
    report = json.loads(driver.stdout)
    return report["start_s"], report["start_cpu_s"], report["cases"]


def check(cases: list[str], tmp_path) -> None:
    start_s, start_cpu_s, results = refuse(cases, tmp_path)
    for case in cases:
        r = results[case]
        prefix = f"{PLAN}: error:" if case in PLAN_CATALOGUE else "parallel_lab: error:"
        assert r["code"] == 2 and prefix in r["stderr"], f"{case}: exit {r['code']}\n{r['stderr']}"
        if case in PLAN_CATALOGUE:
            (line,) = r["stderr"].strip().splitlines()
            assert PLAN_CATALOGUE[case][1] in line and "; " in line, f"{case}: {line}"  # the value, and the fix
            assert not (tmp_path / case).exists(), f"{case}: the plan folder was written"
        assert not r["deepspeed"], f"{case}: DeepSpeed imported on the way to the refusal"
        assert not r["torch"], f"{case}: torch imported on the way to the refusal"
    # CPU seconds (user + sys): what the refusal costs, which a loaded machine does not stretch
    # (at load 13 on 2 cores a 0.8 s refusal took 3-6 s of wall); wall beside it.
    slowest = max(cases, key=lambda case: results[case]["cpu_s"])
    r = results[slowest]
    print(
        f"\nslowest refusal: {slowest} {start_cpu_s + r['cpu_s']:.2f} s of CPU (start {start_cpu_s:.2f} s + "
        f"{r['cpu_s']:.2f} s; wall {start_s + r['seconds']:.2f} s) over {len(cases)} refusals"
    )


def test_one_refusal_from_each_place_imports_no_torch(tmp_path):
    check(list(IN_MAKE_TEST), tmp_path)


def test_every_plan_refusal_imports_no_torch(tmp_path):
    """The planner refuses each bad input of its catalogue before torch, as the training command does."""
    check(list(PLAN_CATALOGUE), tmp_path)


@pytest.mark.extra
def test_every_catalogue_refusal_imports_no_torch(tmp_path):
    check(STATIC, tmp_path)


# --help (no torch, no Hydra, every group listed): tests/unit/test_help.py


def test_a_valid_runs_parent_imports_no_torch_where_no_gpu_driver_is():
    """A single run's parent validates (the memory check sized from model.*: models/counts.py) and
    launches without torch on a machine without a GPU driver (comm/dist_env.py cuda_gpus): ~1.5 s of
    CPU per command. The ranks import it (a sweep's parent too: its report judges parity on tensors)."""
    from parallel_lab.comm.dist_env import GPU_DRIVER_PATHS

    probe = (
        "import sys\n"
        "from parallel_lab.config import check_overrides_compose\n"
        "assert check_overrides_compose(['strategy=ddp', 'model=resnet18', 'world_size=4']).validated\n"
        "import parallel_lab.cli.launch, parallel_lab.cli.main\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    if not any(glob.glob(pattern) for pattern in GPU_DRIVER_PATHS):
        assert result.stderr.strip().splitlines()[-1] == "False", result.stderr[-2000:]
