"""Shared by the tp/pp distributed test bodies: build a strategy from the real config files and
train it with the real loop inside ranks started by ``parallel_lab.testing.run_ranks``, then
compare with the independent single-process reference (tests/reference.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.dist_env import read_dist_env
from parallel_lab.strategies import get_strategy_class
from parallel_lab.train import train
from tests.reference import global_batches, reference_run


def compose_config(*overrides: str) -> DictConfig:
    """conf/config.yaml + overrides, validated exactly as the parent does before a run."""
    from hydra import compose, initialize_config_dir

    from parallel_lab.config import CONF_DIR, register_configs, validate

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["trainer.progress=false", "trainer.threads_per_rank=1",
                                           f"data.size={DATA_SIZE}", *overrides])
    return validate(cfg)


DATA_SIZE = 512  # synthetic samples: enough for a few steps, and cheap to generate per configuration


class Reference:
    """The plain-torch single-process run every configuration is compared with."""

    def __init__(self, steps: int, global_batch: int, grad_clip: float = 0.0) -> None:
        if grad_clip:
            self.losses, self.net = clipped_reference_run(steps, global_batch, grad_clip, DATA_SIZE)
        else:
            self.losses, _, self.net = reference_run("cnn", steps=steps, global_batch=global_batch, threads=1,
                                                     data_size=DATA_SIZE)
        self.params = [p.detach().clone() for p in self.net.parameters()]


class References:
    """One reference per gradient-clipping value, computed when first needed."""

    def __init__(self, steps: int, global_batch: int) -> None:
        self.steps, self.global_batch, self.cache = steps, global_batch, {}

    def get(self, grad_clip: float) -> Reference:
        if grad_clip not in self.cache:
            self.cache[grad_clip] = Reference(self.steps, self.global_batch, grad_clip)
        return self.cache[grad_clip]


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


def clipped_reference_run(steps: int, global_batch: int, grad_clip: float, data_size: int = 4096, seed: int = 0):
    """tests/reference.py's loop plus torch's clip_grad_norm_ on the whole single model."""
    from parallel_lab.models.cnn import SmallCNN

    torch.manual_seed(seed)
    net = SmallCNN()
    data = make_synthetic(data_size, seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
    losses, batches = [], global_batches(data_size, global_batch, seed)
    for _ in range(steps):
        idx = next(batches)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(data.tensors[0][idx]), data.tensors[1][idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, net


def reference_accuracy(net: torch.nn.Module, global_batch: int, eval_batches: int, size: int = DATA_SIZE, seed: int = 0) -> float:
    """Accuracy of the reference model on the held-out samples metrics.json uses (no toolkit code)."""
    data = make_synthetic(max(size // 8, 64), seed + 1)
    count = min(len(data), global_batch * eval_batches) // global_batch * global_batch
    with torch.no_grad():
        pred = net(data.tensors[0][:count]).argmax(1)
    return float((pred == data.tensors[1][:count]).double().mean())


def train_and_compare(refs: References, *overrides: str, rtol: float = 1e-4, atol: float = 1e-5):
    """Train one configuration on these ranks; assert losses and full parameters match the
    reference; return (metrics, strategy) for further checks. Runs on every rank."""
    cfg = compose_config(*overrides)
    env = read_dist_env("cpu")
    strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
    metrics = train(cfg, env, strategy)
    label = " ".join(overrides)
    ref = refs.get(cfg.trainer.grad_clip)
    for step, (a, b) in enumerate(zip(metrics["losses"], ref.losses, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"[{label}] rank {env.rank} step {step}: loss {a} vs reference {b}"
    # Every rank must report the very same loss floats (the loss is broadcast/reduced, not local).
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, metrics["losses"])
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    full = strategy.full_parameters()
    assert len(full) == len(ref.params), f"[{label}] {len(full)} gathered parameters vs {len(ref.params)}"
    for i, (got, want) in enumerate(zip(full, ref.params)):
        assert got.shape == want.shape, f"[{label}] parameter {i}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        err = (got.cpu() - want).abs().max().item()
        assert err <= atol, f"[{label}] parameter {i} differs from the reference by {err}"
    acc = reference_accuracy(ref.net, cfg.trainer.global_batch, cfg.trainer.eval_batches)
    assert metrics["eval_accuracy"] == acc, f"[{label}] eval accuracy {metrics['eval_accuracy']} vs reference {acc}"
    return metrics, strategy, ref


STEPS, BATCH = 3, 32  # the tp/pp CLI runs and their plain-torch reference


def cnn_reference() -> tuple[list[float], float, float]:
    """(losses, checksum, sum of |weights|) of the single-process cnn run the tp/pp tests compare to."""
    losses, checksum, net = reference_run("cnn", steps=STEPS, global_batch=BATCH, data_size=DATA_SIZE)
    scale = float(sum(p.detach().abs().sum() for p in net.parameters()))
    return losses, checksum, scale
