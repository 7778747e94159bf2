"""What metrics.json gets from a finished run (``parallel_lab.protocol.RunMetrics``), and the loop's
state it is built from: the run's config and machine, each rank's measured record beside the
planner's prediction, the resume and checkpoint fields, and BatchNorm's record."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint import Checkpointer, Resumed
from parallel_lab.comm.counter import CommCounter
from parallel_lab.comm.dist_env import DistEnv
from parallel_lab.comm.placement import inter_host_bytes_per_step
from parallel_lab.config.resources import allowed_cores
from parallel_lab.models import build_meta_model, norm_of
from parallel_lab.plan.predict import predicted_metrics
from parallel_lab.protocol import RANK_START_ENV, RunMetrics, kernel_dispatch
from parallel_lab.strategies import batchnorm
from parallel_lab.strategies.base import Strategy
from parallel_lab.worker.metrics import (
    device_memory,
    gather_from_ranks,
    mesh_metrics,
    model_flops_by_kind,
    peak_rss_bytes,
    rank0_planned_psi,
    timed_median,
)
from parallel_lab.worker.profile import StepProfiler


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


def closed_ranges(ranges: list[dict], steps: int) -> list[dict]:
    """world_size_history with every range's end: [{from_step, to_step, world_size, strategy}]."""
    ends = [r["from_step"] for r in ranges[1:]] + [steps]
    return [{**r, "to_step": end} for r, end in zip(ranges, ends)]


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
        world_size_history=closed_ranges(state.history.get("world_size_history", []), t.steps),
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


def run_metrics(cfg: DictConfig, env: DistEnv, strategy: Strategy, run: RunRecord) -> RunMetrics:
    """The run's metrics (complete on rank 0; the gathers are collective)."""
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
