"""Distributed test body: resharding a checkpoint into another layout, then writing it back out.

Each rank sets up the target strategy, restores ``trainer.resume=<source>`` with
``trainer.reshard=true`` through the real Checkpointer (full state read offline, scattered by the
strategy's ``State.load_full``), then saves a checkpoint in the target's own format without
training. The test reads both checkpoints back as full states and compares them bit for bit.
``broken`` plants a known bug in the full state on its way in, to show the comparison catches it."""

from __future__ import annotations

import gc

import torch

from parallel_lab.checkpoint import Checkpointer
from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.config import load_run_config
from parallel_lab.models import build_model
from parallel_lab.optim import optimizer_factory
from parallel_lab.strategies import get_strategy_class


def _break(optim: dict, broken: str) -> dict:
    """The bugs a resharding bridge could have: Adam's moments swapped, its step counter reset."""
    if broken == "swap_moments":
        return {n: {**s, "exp_avg": s["exp_avg_sq"], "exp_avg_sq": s["exp_avg"]} for n, s in optim.items()}
    if broken == "step_not_restored":
        return {n: {**s, "step": torch.zeros_like(s["step"])} for n, s in optim.items()}
    return optim


def reshard_and_save(rank: int, world_size: int, config_paths: list[str], broken: str = "") -> None:
    for path in config_paths:
        cfg = load_run_config(path)
        env = read_dist_env(cfg.device)
        strategy_cls = get_strategy_class(cfg.strategy.name)
        strategy_cls.init_distributed(env, cfg.dist_timeout_s)
        strategy = strategy_cls(cfg, env)
        model = strategy.norm.convert(build_model(cfg.model, cfg.trainer.seed))
        strategy.setup(model, optimizer_factory(cfg.trainer))
        if broken:
            load = strategy.state.load_full
            strategy.state.load_full = lambda params, optim: load(params, _break(optim, broken))
        checkpointer = Checkpointer(cfg, env, strategy)
        resumed = checkpointer.restore()
        checkpointer.save(resumed.step, resumed.batches_consumed, resumed.history)
        strategy.teardown()
        del strategy, checkpointer
        gc.collect()


def train_resharded(rank: int, world_size: int, config_paths: list[str], broken: str = "") -> None:
    """Whole runs (tests/support/bodies/runs.py::record_run) that continue trainer.resume=<source>
    with trainer.reshard=true; ``broken`` plants the same bugs as reshard_and_save, on the way in."""
    from tests.support.bodies.runs import record_run

    for path in config_paths:
        cls = get_strategy_class(load_run_config(path).strategy.name)
        if broken:
            state = type("BrokenState", (cls.State,), {"load_full": _broken_load(cls.State.load_full, broken)})
            cls = type(f"Broken{cls.__name__}", (cls,), {"State": state})
        record_run(path, cls)


def _broken_load(load, broken: str):
    def load_full(self, params: dict, optim: dict) -> None:
        load(self, params, _break(optim, broken))

    return load_full
