"""Distributed test bodies for BatchNorm (tests/integration/test_batchnorm.py): real gloo ranks, no mocks."""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.config import load_run_config
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.base import Strategy
from parallel_lab.strategies.batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm, running_stats
from parallel_lab.worker.train import train


def sync_matches_full_batch(rank: int, world_size: int, channels: int = 3, batch: int = 8) -> None:
    """CpuSyncBatchNorm on each rank's share of a batch = BatchNorm2d on the whole batch: outputs,
    input gradients, summed affine gradients and running statistics, to float rounding."""
    torch.manual_seed(0)
    x, g = torch.randn(batch, channels, 5, 5) * 3 + 1, torch.randn(batch, channels, 5, 5)
    full = torch.nn.BatchNorm2d(channels)
    with torch.no_grad():
        full.weight.uniform_(0.5, 1.5), full.bias.uniform_(-0.5, 0.5)
    synced = convert_sync_batchnorm(copy.deepcopy(full), dist.new_group(), torch.device("cpu"))
    assert isinstance(synced, CpuSyncBatchNorm)
    xf = x.clone().requires_grad_()
    expected = full(xf)  # one forward: a second would update the running statistics again
    (expected * g).sum().backward()
    part = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    xs = x[part].clone().requires_grad_()
    out = synced(xs)
    (out * g[part]).sum().backward()
    grads = torch.cat([synced.weight.grad, synced.bias.grad])
    dist.all_reduce(grads)
    torch.testing.assert_close(out, expected[part].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xf.grad[part], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads, torch.cat([full.weight.grad, full.bias.grad]), rtol=1e-4, atol=1e-4)
    for name, buf in running_stats(synced).items():
        torch.testing.assert_close(buf, running_stats(full)[name], rtol=1e-5, atol=1e-6)


def train_runs(rank: int, world_size: int, runs: list[list[str]]) -> None:
    """Train every (config, broken) in turn (broken: "" or a deliberately broken variant from
    BROKEN); rank 0 prints each run's losses, batchnorm record and memory as one JSON list."""
    results = []
    for path, broken in runs:
        cfg = load_run_config(path)
        env = read_dist_env(cfg.device)
        cls = get_strategy_class(cfg.strategy.name)
        strategy = BROKEN[broken](cls)(cfg, env) if broken else cls(cfg, env)
        metrics = train(cfg, env, strategy)
        results.append(
            {"losses": metrics.losses, "batchnorm": metrics.batchnorm, "run_dir": cfg.run_dir, "ranks": metrics.ranks}
        )
        strategy.teardown()
        del strategy
        gc.collect()
    if rank == 0:
        print(json.dumps(results))


def checkpoint_round_trip(rank: int, world_size: int, config_path: str, broken: str = "") -> None:
    """Train, save a checkpoint, then load it into a fresh strategy: every running statistic must
    come back bitwise (rank 0 prints what differs, [] when nothing does)."""
    cfg = load_run_config(config_path)
    env = read_dist_env(cfg.device)
    cls = get_strategy_class(cfg.strategy.name)
    make = BROKEN[broken](cls) if broken else cls
    first = make(cfg, env)
    train(cfg, env, first)
    saved = {k: v.detach().clone() for k, v in running_stats(first.model).items()}
    folder = Path(cfg.run_dir) / "manual_ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    first.state.save(folder)
    dist.barrier()
    first.teardown()
    second = make(cfg, env)
    from parallel_lab.models import build_model
    from parallel_lab.worker.train import optimizer_factory

    second.setup(second.norm.convert(build_model(cfg.model, cfg.trainer.seed + 1)), optimizer_factory(cfg.trainer))
    second.state.load(folder)
    loaded = {k: v.detach() for k, v in running_stats(second.model).items()}
    differ = [k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k])]
    per_rank: list = [None] * world_size  # pipeline stages: each checks its own layers (some hold none)
    dist.all_gather_object(per_rank, (len(saved), differ))
    assert sum(n for n, _ in per_rank), "the model has no running statistics"
    second.teardown()
    if rank == 0:
        print(json.dumps(sorted({k for _, d in per_rank for k in d})))


# ----- deliberately broken variants: each must make one test fail -----
def _not_converted(cls: type[Strategy]) -> type[Strategy]:
    """syncbatch requested, but the BatchNorm layers are left plain (never converted)."""
    norm = type("NotConverted", (cls.Norm,), {"convert": lambda self, model: model})
    return type(f"NotConverted{cls.__name__}", (cls,), {"Norm": norm})


def _no_running_stats_sync(cls: type[Strategy]) -> type[Strategy]:
    """Running statistics never made identical across the replicas (each keeps its own)."""
    norm = type("NoStatsSync", (cls.Norm,), {"sync_running_stats": lambda self: None})
    return type(f"NoStatsSync{cls.__name__}", (cls,), {"Norm": norm})


def _drops_buffers(cls: type[Strategy]) -> type[Strategy]:
    """A checkpoint that saves and restores only the parameters: the buffers are lost."""

    def load(self, directory):
        keep = {k: v.clone() for k, v in self.model.state_dict().items() if k in _buffer_names(self.model)}
        cls.State.load(self, directory)
        self.model.load_state_dict(keep, strict=False)  # what a parameters-only save would leave

    state = type("DropsBuffers", (cls.State,), {"load": load})
    return type(f"DropsBuffers{cls.__name__}", (cls,), {"State": state})


def _buffer_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_buffers()}


BROKEN = {"not_converted": _not_converted, "no_stats_sync": _no_running_stats_sync, "drops_buffers": _drops_buffers}
