"""The generic training loop. It never asks which strategy it runs: the strategy owns backward,
the optimizer step and every collective; the loop owns data, timing, the checkpoints' schedule and
the metrics (``parallel_lab.protocol.RunMetrics``)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint import Checkpointer, Resumed
from parallel_lab.comm.counter import CommCounter
from parallel_lab.comm.dist_env import DistEnv
from parallel_lab.comm.placement import inter_host_bytes_per_step
from parallel_lab.config.resources import allowed_cores
from parallel_lab.data import eval_batches, load_datasets, train_batches
from parallel_lab.models import build_meta_model, build_model, count_params, norm_of, training_loss
from parallel_lab.models.recompute import set_recompute
from parallel_lab.optim import make_scheduler, optimizer_factory
from parallel_lab.plan.predict import predicted_metrics
from parallel_lab.protocol import (
    OPTIMIZER_LABEL,
    RANK_START_ENV,
    STEP_LABEL,
    RunMetrics,
    kernel_dispatch,
    save_final_params,
)
from parallel_lab.strategies import batchnorm
from parallel_lab.strategies.base import Strategy
from parallel_lab.worker.faults import maybe_inject_fault
from parallel_lab.worker.metrics import (
    device_memory,
    gather_from_ranks,
    machine_state,
    mesh_metrics,
    model_flops_by_kind,
    param_checksum,
    param_sha256,
    peak_rss_bytes,
    rank0_planned_psi,
    timed_median,
)
from parallel_lab.worker.noise import jitter_gradients, jitter_one_ulp
from parallel_lab.worker.profile import StepProfiler, no_range
from parallel_lab.worker.replicas import replica_record


def _progress(steps: int, enabled: bool, first: int = 0):
    if not enabled:
        return range(first, steps)
    from tqdm import tqdm

    return tqdm(range(first, steps), desc="train", unit="step", dynamic_ncols=True, initial=first, total=steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopState:
    """Where training stands: what a checkpoint saves and a resumed run continues from."""

    first_step: int = 0  # steps already done when this process started
    consumed: int = 0  # global batches the sampler has handed out
    history: dict = field(default_factory=lambda: {"losses": [], "fwd_bwd": [], "optimizer": []})
    resumed: Resumed | None = None

    @classmethod
    def start(cls, resumed: Resumed | None, world: dict | None = None) -> LoopState:
        state = cls() if resumed is None else cls(resumed.step, resumed.batches_consumed, resumed.history, resumed)
        if world is not None:  # world_size_history: which world and strategy trained which steps
            ranges = [r for r in state.history.get("world_size_history", []) if r["from_step"] < state.first_step]
            if ranges:
                ranges[-1] = {**ranges[-1], "to_step": state.first_step}
            if not ranges or {k: ranges[-1][k] for k in world} != world:
                ranges.append({"from_step": state.first_step, **world})
            state.history["world_size_history"] = ranges
        return state

    def record(self, loss: float, fwd_bwd_s: float, optimizer_s: float) -> None:
        self.history["losses"].append(loss)
        self.history["fwd_bwd"].append(fwd_bwd_s)
        self.history["optimizer"].append(optimizer_s)


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
    metrics = _metrics(cfg, env, strategy, run)
    metrics.batchnorm = batchnorm_record(cfg, strategy, probe, metrics.ranks)
    metrics.machine = {**machine, "end": machine_state()}
    return replace(metrics, **replica_record(strategy))  # replicas bit for bit equal? (collective)


def batchnorm_record(cfg: DictConfig, strategy: Strategy, probe: batchnorm.StatisticsProbe, ranks: list[dict]) -> dict:
    """What BatchNorm did in this run (RunMetrics.batchnorm; {} for a model without it): over how
    many samples its statistics were taken, whether the replicas' running statistics ended
    identical (collective), and the bytes per step it added, measured on its own group vs theory."""
    if norm_of(cfg.model) == "group":  # decided by the config, the same on every rank: a pipeline
        return {}  # stage without BatchNorm layers must still join the collective below
    layers = batchnorm.batchnorm_layers(strategy.model)
    differ = batchnorm.replicas_differ(gather_from_ranks(batchnorm.running_stats_digests(strategy.model)))
    synced = any(batchnorm.is_synced(m) for m in layers)  # (a stage without layers: False)
    world = strategy.dp_size if synced else 1
    theory = batchnorm.sync_comm_bytes(strategy.model, world, cfg.trainer.grad_accum) if synced else {}
    target = strategy.norm.running_stats_group()
    if not synced and target is not None:
        theory = {"broadcast": float(batchnorm.running_stats_bytes(strategy.model))}
    measured = max(r["comm_bytes_by_group"].get(batchnorm.SYNC_LABEL, 0.0) for r in ranks)
    return {
        "layers": len(layers),
        "synced": synced,
        "samples": sorted(probe.samples),
        "running_stats_identical": not differ,
        "running_stats_differ": differ[:4],
        "comm_bytes_per_step": measured,
        "comm_theory_bytes_per_step": sum(theory.values()),
        "comm_theory_by_op": theory,
    }


def _closed_ranges(ranges: list[dict], steps: int) -> list[dict]:
    """world_size_history with every range's end: [{from_step, to_step, world_size, strategy}]."""
    ends = [r["from_step"] for r in ranges[1:]] + [steps]
    return [{**r, "to_step": end} for r, end in zip(ranges, ends)]


def _final_parameters(cfg: DictConfig, env: DistEnv, strategy: Strategy, names: list[str]) -> tuple[float, str]:
    """The full final parameters' checksum and sha256; rank 0 also saves them for the parity check."""
    full = strategy.state.full_parameters()
    if env.is_main and cfg.run_dir:
        save_final_params(Path(cfg.run_dir), names, full)
    return param_checksum(full), param_sha256(full)


@dataclass
class RunRecord:
    """What the loop ends a run with, for metrics.json."""

    state: LoopState
    checkpointer: Checkpointer
    counter: CommCounter
    profiler: StepProfiler | None
    memory: dict  # this rank's measured model-state bytes (the last step's)
    num_params: int
    accuracy: float | None
    checksum: float
    digest: str


def _rank_info(cfg: DictConfig, env: DistEnv, strategy: Strategy, run: RunRecord, step_times: list[float]) -> dict:
    """This rank's record (RunMetrics.ranks): memory measured beside the textbook and the
    planner's prediction, communication per step by op and by group, device and profile figures."""
    steps = max(1, cfg.trainer.steps - run.state.first_step)
    counter = run.counter
    analytic = {f"analytic_{k}": v for k, v in strategy.memory.analytic(run.num_params).items()}
    # The planner's exact prediction (parallel_lab.plan), from this run's config alone, beside what was measured.
    predicted = predicted_metrics(cfg, type(strategy), build_meta_model(cfg.model), env.rank)
    return {
        "rank": env.rank,
        "cores": allowed_cores(),  # where it ran: its own trainer.threads cores under trainer.pin_cores
        "peak_rss_bytes": peak_rss_bytes(),
        **run.memory,
        **analytic,
        **predicted,
        "comm_bytes_per_step": counter.total_bytes / steps,
        "comm_bytes_by_op": {op: n / steps for op, n in counter.bytes_by_op.items()},
        "comm_bytes_by_group": {group: n / steps for group, n in counter.bytes_by_group.items()},
        **device_memory(env.device),
        **(run.profiler.rank_record(step_times) if run.profiler is not None else {}),
    }


def _resume_fields(cfg: DictConfig, run: RunRecord) -> dict:
    """Where the run started from and what its checkpoints cost."""
    state, checkpointer, t = run.state, run.checkpointer, cfg.trainer
    return dict(
        resumed_from_step=state.first_step if state.resumed else None,
        resumed_from=str(state.resumed.path) if state.resumed else None,
        resharded_from=state.resumed.resharded_from if state.resumed else None,
        initialized_from=checkpointer.initialized_from,
        world_size_history=_closed_ranges(state.history.get("world_size_history", []), t.steps),
        checkpoint_every=t.checkpoint_every,
        checkpoint_save_s=statistics.median(checkpointer.save_seconds) if checkpointer.save_seconds else None,
        checkpoint_load_s=checkpointer.load_seconds,
        checkpoint_bytes=checkpointer.last_bytes or None,
    )


def _run_fields(cfg: DictConfig, env: DistEnv, strategy: Strategy, num_params: int) -> dict:
    """What was run, where and how (config and machine)."""
    t = cfg.trainer
    flops = model_flops_by_kind(cfg.model, t.global_batch)
    return dict(
        strategy=cfg.strategy.name,
        launcher=cfg.launcher.name,
        rank_start=os.environ.get(RANK_START_ENV, "exec"),
        world_size=env.world_size,
        backend=env.backend if strategy.plan.needs_process_group else "none",
        device=str(env.device),
        device_name=torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
        model=cfg.model.name,
        data=cfg.data.name,
        params=num_params,
        global_batch=t.global_batch,
        optimizer=t.optimizer,
        lr=t.lr,
        grad_accum=t.grad_accum,
        steps=t.steps,
        warmup_steps=t.warmup_steps,
        model_flops_per_step=sum(flops.values()),
        model_flops_by_kind=flops,
        threads=t.threads,
        ulp_jitter_seed=t.ulp_jitter_seed,
        noise_rerun=t.noise_rerun,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        kernel_dispatch=kernel_dispatch(),
        norm=norm_of(cfg.model),
        recompute=str(t.get("recompute", "none")),
        moe_experts=int(cfg.model.get("moe_experts") or 0),
        strategy_options=OmegaConf.to_container(cfg.strategy, resolve=True),
    )


def _metrics(cfg: DictConfig, env: DistEnv, strategy: Strategy, run: RunRecord) -> RunMetrics:
    t, history = cfg.trainer, run.state.history
    comm_per_step = run.counter.total_bytes / max(1, t.steps - run.state.first_step)
    step_times = [a + b for a, b in zip(history["fwd_bwd"], history["optimizer"])]
    ranks = gather_from_ranks(_rank_info(cfg, env, strategy, run, step_times))
    extras = strategy.extra_metrics()
    mesh = strategy.layout.metrics()
    if mesh:
        extras["mesh"] = mesh_metrics(mesh, ranks)
    nodes = cfg.launcher.get("nodes") or 1
    nproc_per_node = cfg.launcher.get("nproc_per_node") or env.world_size
    step_time = timed_median(step_times, t.warmup_steps)
    theory_psi = strategy.run_comm_theory_psi(run.num_params)
    planned_psi = None if theory_psi is not None else rank0_planned_psi(cfg, env.rank, type(strategy), run.num_params)
    return RunMetrics(
        **_run_fields(cfg, env, strategy, run.num_params),
        losses=history["losses"],
        final_loss=history["losses"][-1],
        step_time_s=step_time,
        step_times_s=step_times,
        step_split_s={part: timed_median(history[part], t.warmup_steps) for part in ("fwd_bwd", "optimizer")},
        samples_per_s=t.global_batch / step_time,
        eval_accuracy=run.accuracy,
        final_param_checksum=run.checksum,
        final_param_sha256=run.digest,
        attempt=env.restart_count,
        **_resume_fields(cfg, run),
        comm_bytes_per_step=comm_per_step,
        comm_volume_psi=comm_per_step / (4 * run.num_params),
        comm_theory_psi=theory_psi,
        comm_planned_psi=planned_psi,
        ranks=ranks,
        strategy_extras=extras,
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        inter_host_bytes_per_step=inter_host_bytes_per_step(ranks, nodes, nproc_per_node, mesh),
        profile=run.profiler.run_record(step_times, t.warmup_steps) if run.profiler is not None else {},
    )
