"""Every strategy x impl x model at its defaults: each combination the parent accepts trains to
completion and evaluates at the end (trainer.eval_batches=2, the default), through the worker's
own steps (tests/support/bodies/runs.py ``train_and_record``), all of one model and world size in
ONE set of real gloo ranks (one start-up and one DeepSpeed import per rank). The combinations are
listed from the registry (each Options' ``impl`` choices) and conf/model/, so a strategy, impl or
model added later is in the check without editing it; one the parent refuses (a one-line
ConfigError, judged by its own tests) is skipped with the refusal as the reason.

Defaults overridden, and why (time; nothing else):
- ``trainer.steps=3`` (20): the 2 warm-up steps (trainer.warmup_steps) plus one timed step, so
  every code path of a step runs; the other 17 repeat them.
- ``trainer.global_batch=8`` (64): each run's compute an eighth (pp's 4 micro-batches of 2
  samples, 4 per data-parallel rank); evaluation then reads 2 batches of 8 held-out samples.
- ``trainer.progress=false`` (true): the progress bar is output only (tests/support/cli.py).

In ``make test``: model=vit under every strategy and impl (the model every strategy and impl
accepts, with the most paths: blocks, dropout keys, tp splits), about 20 s. The other models (cnn,
resnet18, gpt, any added) are ``extra`` (the default suite evaluates the cnn at its default eval_batches in the
pp, tp and data-parallel matrices against the reference's accuracy: tests/support/model_parallel.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from omegaconf import OmegaConf

from parallel_lab.cli.run import load_metrics, run_ranks
from parallel_lab.errors import ConfigError
from parallel_lab.strategies import options_schemas
from tests.support.bodies.runs import train_and_record
from tests.support.cli import ROOT, write_config

OVERRIDES = ("trainer.steps=3", "trainer.global_batch=8")
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
IN_MAKE_TEST = "vit"


def impls(options: type) -> list[str | None]:
    """The strategy's ``strategy.impl`` choices (None: it has no impl key)."""
    field = {f.name: f for f in dataclasses.fields(options)}.get("impl")
    return [None] if field is None else [choice.value for choice in type(field.default)]


def combinations(model: str) -> dict[str, tuple[str, ...]]:
    """id -> overrides: every strategy x impl on ``model``. DeepSpeed's pipeline and AutoTP last:
    after them a ZeRO engine in the same process finds DeepSpeed's model-parallel state set
    (``mpu`` None in deepspeed.initialize); every run of the CLI is a process of its own."""
    combos = {}
    for name, options in options_schemas().items():
        for impl in impls(options):
            label = "-".join(x for x in (name, impl, model) if x)
            data = ("data=tokens",) if model == "gpt" else ()  # gpt reads tokens; the rest the default images
            combos[label] = (f"strategy={name}", f"model={model}", *data, *((f"strategy.impl={impl}",) if impl else ()))
    return dict(sorted(combos.items(), key=lambda item: "strategy.impl=deepspeed" in item[1]))


def _ids() -> list:
    marks = {m: () if m == IN_MAKE_TEST else (pytest.mark.extra,) for m in MODELS}
    return [pytest.param(label, m, marks=marks[m], id=label) for m in MODELS for label in combinations(m)]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """get(model) -> id -> the run's metrics, or the parent's one-line refusal (each model's runs
    trained once, on first use)."""
    root = tmp_path_factory.mktemp("defaults")
    done: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in done:
            done[model] = train_every_combination(root, combinations(model))
        return done[model]

    return get


def train_every_combination(root, combos: dict[str, tuple[str, ...]]) -> dict:
    results: dict = {}
    by_world: dict[int, list[str]] = {}
    for label, overrides in combos.items():
        try:
            path = write_config(root / f"{label}.yaml", *overrides, *OVERRIDES)
        except ConfigError as refused:
            results[label] = str(refused)
            continue
        by_world.setdefault(int(OmegaConf.load(path).world_size), []).append(path)
    for world, paths in sorted(by_world.items()):
        try:
            run_ranks(train_and_record, world, timeout=600, config_paths=paths)
        except AssertionError as crashed:  # the runs before the crash stand; the others fail with it
            results.update({label: crashed for label in combos if str(root / f"{label}.yaml") in paths})
    for label in combos:
        if (root / label / "metrics.json").is_file():
            results[label] = load_metrics(root / label)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("label, model", _ids())
def test_runs_to_completion_at_its_defaults_evaluation_included(default_runs, label, model):
    run = default_runs(model)[label]
    if isinstance(run, str):
        pytest.skip(f"refused by the parent: {run}")
    if isinstance(run, AssertionError):
        raise run
    assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"]), run["losses"]
    assert run["eval_accuracy"] is not None and 0.0 <= run["eval_accuracy"] <= 1.0, run["eval_accuracy"]
