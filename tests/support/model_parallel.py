"""Shared by the tp/pp distributed test bodies: build a strategy from the real config files and
train it with the real loop inside ranks started by ``parallel_lab.cli.run.run_ranks``, then
compare with the independent single-process reference (tests/support/reference.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.protocol import RunMetrics
from parallel_lab.report.parity import Replicas
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.base import Strategy
from parallel_lab.worker.train import train
from tests.support.reference import ParityReference, parity_reference


def compose_config(*overrides: str) -> DictConfig:
    """conf/config.yaml + overrides, validated exactly as the parent does before a run. Inside ranks
    (a process group up) rank 0 composes and broadcasts the result, or its refusal: every rank
    would compose the same text the same way, and Hydra's compose is about 0.25 s of CPU per call
    (a matrix's configurations are composed by every rank in turn)."""
    return computed_on_rank0(_compose, overrides)


def _compose(overrides: tuple[str, ...]) -> DictConfig:
    from parallel_lab import config

    return config.validate(
        config.compose_config(
            ["trainer.progress=false", "trainer.threads_per_rank=1", f"data.size={DATA_SIZE}", *overrides]
        )
    )


def shared_plans(cfg: DictConfig, strategy_cls: type, model: torch.nn.Module) -> list:
    """parallel_lab.plan.predict.plan_world(cfg, strategy_cls, model), every rank's plan, computed on
    rank 0 and broadcast inside ranks (as compose_config does with a config): each rank computed the
    same plans of the whole world, and the planner's activation count is a meta forward per distinct
    stage (0.2-0.9 s of CPU for a vit or a pp stage set), so a world of 4 paid it four times. A
    collective: every rank calls it at the same point."""
    from parallel_lab.plan.predict import plan_world

    return computed_on_rank0(plan_world, cfg, strategy_cls, model)


def computed_on_rank0(fn, *args):
    """fn(*args) on rank 0, broadcast to every rank (or its exception, raised on every rank: the
    others must not wait forever); fn(*args) itself outside ranks. A collective: every rank calls it
    at the same point with the same arguments."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return fn(*args)
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn(*args)
        except Exception as failed:
            box[0] = failed
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


DATA_SIZE = 512  # synthetic samples: enough for a few steps, and cheap to generate per configuration


def reference_for(steps: int, global_batch: int, grad_clip: float = 0.0) -> ParityReference:
    """The plain-torch single-process run (and its noise floor) every configuration is compared with."""
    return parity_reference(
        "cnn", steps=steps, global_batch=global_batch, threads=1, data_size=DATA_SIZE, grad_clip=grad_clip
    )


def assert_one_line_config_error(strategy: str, overrides, named) -> None:
    """Composing ``strategy=<strategy> <overrides>`` must fail with a one-line ConfigError naming ``named``."""
    import pytest

    from parallel_lab.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        compose_config(f"strategy={strategy}", *overrides)
    message = str(info.value)
    assert "\n" not in message
    for text in named:
        assert text in message, f"{text!r} not in {message!r}"


def reference_accuracy(
    net: torch.nn.Module, global_batch: int, eval_batches: int, size: int = DATA_SIZE, seed: int = 0
) -> float:
    """Accuracy of the reference model on the held-out samples metrics.json uses (no toolkit code)."""
    data = make_synthetic(max(size // 8, 64), seed + 1)
    count = min(len(data), global_batch * eval_batches) // global_batch * global_batch
    with torch.no_grad():
        pred = net(data.tensors[0][:count]).argmax(1)
    return float((pred == data.tensors[1][:count]).double().mean())


def train_configuration(steps: int, global_batch: int, *overrides: str) -> tuple[DictConfig, Strategy, RunMetrics]:
    """Train one configuration on these ranks through the real loop; (cfg, strategy, metrics)."""
    cfg = compose_config(f"trainer.steps={steps}", f"trainer.global_batch={global_batch}", *overrides)
    env = read_dist_env("cpu")
    strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
    return cfg, strategy, train(cfg, env, strategy)


def assert_matches_reference(cfg: DictConfig, strategy: Strategy, metrics: RunMetrics, label: str) -> ParityReference:
    """Assert losses and full parameters match the reference under the parity criterion, and eval
    accuracy exactly; return the reference. Runs on every rank; every collective comes before the
    first assertion that could fail on one rank only, so a failure leaves the ranks in step."""
    env = read_dist_env("cpu")
    ref = reference_for(cfg.trainer.steps, cfg.trainer.global_batch, cfg.trainer.grad_clip)
    # Every rank must report the very same loss floats (the loss is broadcast/reduced, not local).
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, metrics.losses)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    full = strategy.state.full_parameters()
    for (name, want), got in zip(ref.params.items(), full, strict=True):
        assert got.shape == want.shape, f"[{label}] {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    ref.assert_matches(metrics.losses, full, f"[{label}] rank {env.rank}", Replicas.of(metrics))
    acc = reference_accuracy(ref.net, cfg.trainer.global_batch, cfg.trainer.eval_batches)
    assert metrics.eval_accuracy == acc, f"[{label}] eval accuracy {metrics.eval_accuracy} vs reference {acc}"
    return ref


def judge_gpt_on_rank0(cfg: DictConfig, metrics: RunMetrics, full, rank: int, label: str, reference: str) -> None:
    """Rank 0 alone judges the run's losses and full parameters against the single-process gpt
    ``reference`` under the parity criterion (the parameters are the same on every rank; 2 cores,
    one reference), at the run's optimizer, steps and batch."""
    if rank != 0:
        return
    t = cfg.trainer
    ref = parity_reference(
        reference, optimizer=str(t.optimizer), steps=t.steps, global_batch=t.global_batch, threads=1,
        data_size=DATA_SIZE,
    )  # fmt: skip
    ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))


def assert_state_as_planned(row: dict, label: str) -> None:
    """A rank's measured parameters, gradients and optimizer state equal the planner's, to the byte."""
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])


STEPS, BATCH = 3, 32  # the tp/pp CLI runs and their plain-torch reference


def cnn_reference() -> ParityReference:
    """The single-process cnn run (and its noise floor) the tp/pp CLI runs are compared with."""
    return reference_for(STEPS, BATCH)
