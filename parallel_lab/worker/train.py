"""The generic training loop. It never asks which strategy it runs: the strategy owns backward,
the optimizer step and every collective; the loop owns data, timing and the metrics."""
from __future__ import annotations

import os
import statistics
import signal
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint import Checkpointer
from parallel_lab.data import eval_batches, load_datasets, train_batches
from parallel_lab.worker.dist_env import DistEnv
from parallel_lab.worker.metrics import (
    device_memory,
    save_final_params,
    gather_from_ranks,
    param_checksum,
    param_sha256,
    peak_rss_bytes,
    timed_median,
)
from parallel_lab.models import build_model, count_params
from parallel_lab.report.parity import jitter_one_ulp
from parallel_lab.strategies.base import Strategy


def optimizer_factory(trainer: DictConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    def make(params):
        if trainer.optimizer == "sgd":
            return torch.optim.SGD(params, lr=trainer.lr, momentum=trainer.momentum, weight_decay=trainer.weight_decay)
        # foreach=False: the same per-tensor kernels whatever the wrapping, so sharded and
        # replicated runs do bit-comparable updates.
        return torch.optim.Adam(params, lr=trainer.lr, weight_decay=trainer.weight_decay, foreach=False)

    return make


def _progress(steps: int, enabled: bool, first: int = 0):
    if not enabled:
        return range(first, steps)
    from tqdm import tqdm

    return tqdm(range(first, steps), desc="train", unit="step", dynamic_ncols=True, initial=first, total=steps)


class InjectedFault(RuntimeError):
    """Raised by ``fault.rank``/``fault.step`` to test how a run fails."""


def maybe_inject_fault(fault: DictConfig, env: DistEnv, step: int, at: str) -> None:
    """Fail as fault.* asks, only in the first attempt (a torchrun restart must be able to finish)."""
    if fault.rank != env.rank or fault.step != step or fault.at != at or env.restart_count > 0:
        return
    if fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault on rank {env.rank} at {at} {step} (fault.rank={env.rank} fault.step={step})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: DictConfig, env: DistEnv, strategy: Strategy) -> dict:
    """Run cfg.trainer.steps optimizer steps (resuming from a checkpoint if there is one);
    return metrics (complete on rank 0)."""
    t = cfg.trainer
    model = build_model(cfg.model, t.seed)
    num_params = count_params(model)
    param_names = [name for name, _ in model.named_parameters()]  # full_parameters() keeps this order
    if t.ulp_jitter_seed is not None:  # a noise-floor rerun of the baseline (parallel_lab/parity.py)
        jitter_one_ulp(model, t.ulp_jitter_seed)
    # Installed before setup: libraries that keep a reference to a collective (DeepSpeed picks
    # its all-gather function once, at initialisation) must keep the counted one.
    counter = strategy.comm.install() if dist.is_initialized() else strategy.comm
    strategy.setup(model, optimizer_factory(t))
    checkpointer = Checkpointer(cfg, env, strategy)
    with counter.paused():
        resumed = checkpointer.restore()  # RNG, sampler position, model and optimizer, or None
    first_step = resumed.step if resumed else 0
    history = resumed.history if resumed else {"losses": [], "fwd_bwd": [], "optimizer": []}
    train_set, eval_set = load_datasets(cfg.data, t.seed)
    consumed = resumed.batches_consumed if resumed else 0
    batches = train_batches(train_set, t.global_batch, strategy.dp_rank, strategy.dp_size, t.seed, consumed)

    memory = {}
    for step in _progress(t.steps, t.progress and env.is_main, first_step):
        maybe_inject_fault(cfg.fault, env, step, "step")
        inputs, targets = next(batches)
        consumed += 1
        _sync(env.device)
        start = time.perf_counter()
        with counter.counting():  # only the strategy's own communication, not the loss report
            micro_losses = [
                strategy.train_step(x.to(env.device), y.to(env.device), i, t.grad_accum)
                for i, (x, y) in enumerate(zip(inputs.chunk(t.grad_accum), targets.chunk(t.grad_accum)))
            ]
            _sync(env.device)
            backward_done = time.perf_counter()
            if step == t.steps - 1:
                with counter.paused():
                    memory = strategy.memory_report()  # gradients and optimizer state both alive here
            optimizer_start = time.perf_counter()
            strategy.optimizer_step()
        _sync(env.device)
        end = time.perf_counter()
        # Split as far as the loop can see: forward+backward (including any communication that
        # overlaps backward) and the optimizer step (including ZeRO's parameter gathers).
        history["fwd_bwd"].append(backward_done - start)
        history["optimizer"].append(end - optimizer_start)
        history["losses"].append(strategy.global_mean_loss(torch.stack(micro_losses).mean()))
        if checkpointer.due(step + 1):
            with counter.paused():
                checkpointer.save(step + 1, consumed, history, lambda s=step + 1: maybe_inject_fault(cfg.fault, env, s, "checkpoint"))

    losses = history["losses"]
    step_times = [a + b for a, b in zip(history["fwd_bwd"], history["optimizer"])]
    steps_run_here = max(1, t.steps - first_step)
    accuracy = strategy.evaluate(eval_batches(eval_set, t.global_batch, t.eval_batches, strategy.dp_rank, strategy.dp_size))
    full = strategy.full_parameters()
    checksum, digest = param_checksum(full), param_sha256(full)
    if env.is_main and cfg.run_dir:
        save_final_params(Path(cfg.run_dir), param_names, full)
    del full
    counter.uninstall()
    comm = {"comm_bytes_per_step": counter.total_bytes / steps_run_here,
            "comm_bytes_by_op": {op: n / steps_run_here for op, n in counter.bytes_by_op.items()}}
    analytic = {f"analytic_{k}": v for k, v in strategy.analytic_memory(num_params).items()}
    rank_info = {"rank": env.rank, "peak_rss_bytes": peak_rss_bytes(), **memory, **analytic, **comm,
                 **device_memory(env.device)}
    ranks = gather_from_ranks(rank_info)
    step_time = timed_median(step_times, t.warmup_steps)
    return {
        "status": "ok",
        "strategy": cfg.strategy.name,
        "launcher": cfg.launcher.name,
        "world_size": env.world_size,
        "backend": env.backend if strategy.needs_process_group else "none",
        "device": str(env.device),
        "model": cfg.model.name,
        "data": cfg.data.name,
        "params": num_params,
        "global_batch": t.global_batch,
        "optimizer": t.optimizer,
        "lr": t.lr,
        "grad_accum": t.grad_accum,
        "steps": t.steps,
        "threads": t.threads,
        "ulp_jitter_seed": t.ulp_jitter_seed,  # set: this run is a noise-floor rerun of the baseline
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "losses": losses,
        "final_loss": losses[-1],
        "step_time_s": step_time,
        "step_times_s": step_times,
        "step_split_s": {part: timed_median(history[part], t.warmup_steps) for part in ("fwd_bwd", "optimizer")},
        "samples_per_s": t.global_batch / step_time,
        "eval_accuracy": accuracy,
        "final_param_checksum": checksum,
        "final_param_sha256": digest,
        "attempt": env.restart_count,  # > 0: torchrun restarted the workers this many times
        "resumed_from_step": first_step if resumed else None,
        "resumed_from": str(resumed.path) if resumed else None,
        "checkpoint_every": t.checkpoint_every,
        "checkpoint_save_s": statistics.median(checkpointer.save_seconds) if checkpointer.save_seconds else None,
        "checkpoint_load_s": checkpointer.load_seconds,
        "checkpoint_bytes": checkpointer.last_bytes or None,
        "comm_bytes_per_step": comm["comm_bytes_per_step"],
        "comm_volume_psi": comm["comm_bytes_per_step"] / (4 * num_params),
        "comm_theory_psi": strategy.comm_theory_psi,
        "ranks": ranks,
        "strategy_options": OmegaConf.to_container(cfg.strategy, resolve=True),
        **strategy.extra_metrics(),
    }
