"""The generic training loop. It never asks which strategy it runs: the strategy owns backward,
the optimizer step and every collective; the loop owns data, timing, the checkpoints' schedule and
the metrics (``parallel_lab.protocol.RunMetrics``)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.checkpoint import Checkpointer
from parallel_lab.comm.counter import CommCounter
from parallel_lab.comm.dist_env import DistEnv
from parallel_lab.data import eval_batches, load_datasets, train_batches
from parallel_lab.models import build_model, count_params, training_loss
from parallel_lab.models.recompute import set_recompute
from parallel_lab.optim import make_scheduler, optimizer_factory
from parallel_lab.protocol import (
    OPTIMIZER_LABEL,
    STEP_LABEL,
    RunMetrics,
    save_final_params,
)
from parallel_lab.strategies import batchnorm
from parallel_lab.strategies.base import Strategy
from parallel_lab.worker.faults import maybe_inject_fault
from parallel_lab.worker.metrics import (
    machine_state,
    param_checksum,
    param_sha256,
    peak_rss_bytes,
)
from parallel_lab.worker.noise import jitter_gradients, jitter_one_ulp
from parallel_lab.worker.profile import StepProfiler, no_range
from parallel_lab.worker.record import LoopState, RunRecord, batchnorm_record, run_metrics
from parallel_lab.worker.replicas import replica_record


def _progress(steps: int, enabled: bool, first: int = 0):
    if not enabled:
        return range(first, steps)
    from tqdm import tqdm

    return tqdm(range(first, steps), desc="train", unit="step", dynamic_ncols=True, initial=first, total=steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    strategy: Strategy,
    counter: CommCounter,
    batch,
    env: DistEnv,
    grad_accum: int,
    measure_memory: bool,
    grad_noise: torch.Generator | None = None,
    region=no_range,
) -> tuple[float, float, float, dict]:
    """One optimizer step: (global loss, forward+backward s, optimizer s, memory report or {}).
    grad_noise: a noise-floor rerun's generator for jitter_gradients (report/parity.py).
    region: named profiler ranges around the timed step and the optimizer (StepProfiler.region)."""
    inputs, targets = batch
    memory, after_backward = {}, {}
    _sync(env.device)
    with region(STEP_LABEL):  # the trace's step: exactly the span the loop times
        start = time.perf_counter()
        with counter.counting():  # only the strategy's own communication, not the loss report
            micro_losses = [
                strategy.train_step(x.to(env.device), y.to(env.device), i, grad_accum)
                for i, (x, y) in enumerate(zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)))
            ]
            _sync(env.device)
            backward_done = time.perf_counter()
            if grad_noise is not None:
                jitter_gradients(strategy.model.parameters(), grad_noise)
            if measure_memory:  # gradients: the optimizer step frees or zeroes them
                with counter.paused():
                    after_backward = strategy.memory.after_backward()
            optimizer_start = time.perf_counter()
            with region(OPTIMIZER_LABEL):
                strategy.optimizer_step()
            strategy.norm.sync_running_stats()  # BatchNorm's running statistics: identical replicas (batchnorm.py)
        _sync(env.device)
        end = time.perf_counter()
    if measure_memory:  # optimizer state: Adam creates it in the first step, so a 1-step run has it only now
        memory = {**after_backward, **strategy.memory.after_step(), **strategy.memory.buffers()}
    # Split as far as the loop can see: forward+backward (including any communication that
    # overlaps backward) and the optimizer step (including ZeRO's parameter gathers).
    loss = strategy.global_mean_loss(torch.stack(micro_losses).mean())
    return loss, backward_done - start, end - optimizer_start, memory


def run_steps(
    cfg: DictConfig,
    env: DistEnv,
    strategy: Strategy,
    counter: CommCounter,
    checkpointer: Checkpointer,
    batches: Iterator,
    state: LoopState,
    scheduler=None,
    profiler: StepProfiler | None = None,
) -> dict:
    """Train from state.first_step to trainer.steps; return the memory report of the last step."""
    t, memory = cfg.trainer, {}
    grad_noise = None if t.grad_ulp_seed is None else torch.Generator().manual_seed(t.grad_ulp_seed)
    for step in _progress(t.steps, t.progress and env.is_main, state.first_step):
        maybe_inject_fault(cfg.fault, env, step, "step")
        batch = next(batches)
        state.consumed += 1
        if profiler is not None:
            profiler.before_step(step)
        loss, fwd_bwd_s, optimizer_s, step_memory = train_step(
            strategy,
            counter,
            batch,
            env,
            t.grad_accum,
            measure_memory=step == t.steps - 1,
            grad_noise=grad_noise,
            region=profiler.region if profiler is not None else no_range,
        )
        if profiler is not None:
            profiler.after_step(step)
        memory = step_memory or memory
        if scheduler is not None:  # after the optimizer step, as DeepSpeed's engine steps its own
            scheduler.step()
        state.record(loss, fwd_bwd_s, optimizer_s)
        if checkpointer.due(step + 1):
            with counter.paused():
                checkpointer.save(
                    step + 1,
                    state.consumed,
                    state.history,
                    lambda s=step + 1: maybe_inject_fault(cfg.fault, env, s, "checkpoint"),
                )
    return memory


def train(cfg: DictConfig, env: DistEnv, strategy: Strategy) -> RunMetrics:
    """Run cfg.trainer.steps optimizer steps (resuming from a checkpoint if there is one);
    return the run's metrics (complete on rank 0)."""
    t = cfg.trainer
    machine = {"start": machine_state()}  # the load the run started under (metrics.json's machine)
    model = build_model(cfg.model, t.seed)
    set_recompute(model, t.get("recompute", "none"))  # models/recompute.py: kept by every strategy's setup
    param_names = [name for name, _ in model.named_parameters()]  # state.full_parameters() keeps this order
    if t.ulp_jitter_seed is not None:  # a noise-floor rerun of the baseline (parallel_lab/report/parity.py)
        jitter_one_ulp(model, t.ulp_jitter_seed)
    # Installed before setup: libraries that keep a reference to a collective (DeepSpeed picks
    # its all-gather function once, at initialisation) must keep the counted one.
    counter = strategy.comm.install() if dist.is_initialized() else strategy.comm
    num_params = count_params(model)
    model = strategy.norm.convert(model)  # model.norm=syncbatch (strategies/batchnorm.py)
    strategy.loss_fn = training_loss(model)  # + the MoE layers' load-balancing loss (models/moe.py)
    strategy.setup(model, optimizer_factory(t))
    probe = batchnorm.StatisticsProbe(strategy.model)
    checkpointer = Checkpointer(cfg, env, strategy)
    with counter.paused():
        world = {"world_size": env.world_size, "strategy": cfg.strategy.name}
        state = LoopState.start(checkpointer.restore(), world)  # RNG, sampler position, model and optimizer
    if state.resumed and state.resumed.resharded_from:
        # The rank's peak RSS so far: model, optimizer state and what reading the checkpoint took
        # (a reshard streams tensor by tensor; docs/checkpoints.md has the measured bound).
        state.resumed.resharded_from.update(load_s=checkpointer.load_seconds, peak_rss_bytes=peak_rss_bytes())
    train_set, eval_set = load_datasets(cfg.data, t.seed)
    batches = train_batches(train_set, t.global_batch, strategy.dp_rank, strategy.dp_size, t.seed, state.consumed)
    scheduler = make_scheduler(t, strategy.optimizer, state.first_step)
    profiler = StepProfiler.maybe(cfg, env, counter)
    memory = run_steps(cfg, env, strategy, counter, checkpointer, batches, state, scheduler, profiler)
    accuracy = strategy.evaluate(
        eval_batches(eval_set, t.global_batch, t.eval_batches, strategy.dp_rank, strategy.dp_size)
    )
    checksum, digest = _final_parameters(cfg, env, strategy, param_names)
    counter.uninstall()
    probe.remove()
    run = RunRecord(state, checkpointer, counter, profiler, memory, num_params, accuracy, checksum, digest)
    metrics = run_metrics(cfg, env, strategy, run)
    metrics.batchnorm = batchnorm_record(cfg, strategy, probe, metrics.ranks)
    metrics.machine = {**machine, "end": machine_state()}
    return replace(metrics, **replica_record(strategy))  # replicas bit for bit equal? (collective)


def _final_parameters(cfg: DictConfig, env: DistEnv, strategy: Strategy, names: list[str]) -> tuple[float, str]:
    """The full final parameters' checksum and sha256; rank 0 also saves them for the parity check."""
    full = strategy.state.full_parameters()
    if env.is_main and cfg.run_dir:
        save_final_params(Path(cfg.run_dir), names, full)
    return param_checksum(full), param_sha256(full)
