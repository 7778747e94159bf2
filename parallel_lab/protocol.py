"""What the parent and its workers agree on: the files of a run folder, what the two json files
hold (``RunMetrics``, ``FailedRun``: written and read by the same code), and the environment.

The parent (``parallel_lab.cli``) writes ``config.yaml`` and reads what the workers leave; the
workers (``parallel_lab.worker``) read ``config.yaml`` and write the rest; the report reads the
records. Every side takes these names from here, the one module all of them share: the parent and
its workers meet only in these files (the layers: docs/architecture.md).

    <run_dir>/config.yaml          the resolved config (parent)
    <run_dir>/metrics.json         rank 0, on success only
    <run_dir>/failed.json          the parent, when a run failed (never beside metrics.json)
    <run_dir>/final_params.pt      rank 0: the full final parameters, for the parity check
    <run_dir>/errors/rank<k>.txt   a failed rank's one-line summary and traceback
    <run_dir>/pids/rank<k>.pid     every worker's pid, to check none outlived the run
    <run_dir>/checkpoints/         the default trainer.checkpoint_dir
    <run_dir>/traces/rank<k>.json  trainer.profile=true: rank k's profiler trace (Chrome trace format)
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.json"
FAILED_FILE = "failed.json"
PARAMS_FILE = "final_params.pt"  # the full (gathered) final parameters, by name: parity compares these
ERRORS_DIR = "errors"
PIDS_DIR = "pids"
CHECKPOINTS_DIR = "checkpoints"
TRACES_DIR = "traces"
# Names of the profiler ranges the trace analysis reads (parallel_lab/worker/timeline.py): a counted
# collective "comm:<op>:<bytes>", a blocking wait "wait:<what>", a pipeline stage waiting for its
# neighbour "idle:<what>", and the loop's own step and optimizer ranges.
COMM_LABEL = "comm:"
WAIT_LABEL = "wait:"
IDLE_LABEL = "idle:"
STEP_LABEL = "parallel_lab:step"
OPTIMIZER_LABEL = "parallel_lab:optimizer"
SUPERVISED_ENV = "PARALLEL_LAB_SUPERVISED"  # set by our launcher: it prints the traceback itself
RANK_START_ENV = "PARALLEL_LAB_RANK_START"  # "fork": this rank was forked from the zygote (worker/zygote.py)


def trace_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trainer.profile trace."""
    return Path(run_dir) / TRACES_DIR / f"rank{rank}.json"


def trace_files(run_dir: str | Path) -> list[Path]:
    """A run's traces, in rank order ([] for a run that was not profiled)."""
    folder = trace_path(run_dir, 0).parent
    return sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:])) if folder.is_dir() else []


def default_checkpoint_dir(run_dir: str | Path) -> Path:
    """Where checkpoints go when trainer.checkpoint_dir is not set."""
    return Path(run_dir) / CHECKPOINTS_DIR


def set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends sig to this process when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write to a temp file then rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


R = TypeVar("R", bound="_Record")


class _Record:
    """A dataclass stored as one json object, written and read by these two methods only."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, path: Path) -> None:
        write_json_atomic(Path(path), self.to_json())

    @classmethod
    def from_json(cls: type[R], data: dict) -> R:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    @classmethod
    def read(cls: type[R], path: Path) -> R:
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass
class FailedRun(_Record):
    """<run_dir>/failed.json: the parent's record of a run that did not finish."""

    status: str = field(default="failed", kw_only=True)
    strategy: Optional[str]
    launcher: Optional[str]
    world_size: Optional[int]
    model: Optional[str]
    error: str  # the one line printed on stderr


@dataclass
class RunMetrics(_Record):
    """<run_dir>/metrics.json: everything one successful run measured (rank 0 writes it).

    Sizes are bytes, times seconds; "Ψ" is the model's fp32 parameter bytes (4 x params).
    """

    status: str = field(default="ok", kw_only=True)
    strategy: str
    launcher: str
    world_size: int  # processes that ran
    backend: str  # gloo | nccl | none (no process group)
    device: str
    model: str
    data: str
    params: int  # parameters of the full model
    global_batch: int
    optimizer: str
    lr: float
    grad_accum: int
    steps: int
    threads: int  # intra-op threads of every process
    ulp_jitter_seed: Optional[int]  # the initial weights were moved one ulp with this seed (report/parity.py)
    cpu_capability: str  # torch's CPU kernel path: the last bits of every float depend on it
    losses: list[float]  # the global batch's mean loss at every step
    final_loss: float
    step_time_s: float  # median after trainer.warmup_steps
    step_times_s: list[float]
    step_split_s: dict[str, float]  # medians of fwd_bwd (with overlapped communication) and optimizer
    samples_per_s: float
    eval_accuracy: Optional[float]  # on trainer.eval_batches held-out batches (None: none run)
    final_param_checksum: float  # float64 sum of every final parameter
    final_param_sha256: str  # equal only for bitwise-identical final weights
    attempt: int  # > 0: torchrun restarted the workers this many times
    resumed_from_step: Optional[int]
    resumed_from: Optional[str]
    checkpoint_every: int
    checkpoint_save_s: Optional[float]  # median wall time of a save, barriers included
    checkpoint_load_s: Optional[float]
    checkpoint_bytes: Optional[int]  # size of the newest checkpoint written
    comm_bytes_per_step: float  # collective volume this rank issued per step, counted
    comm_volume_psi: float  # the same in units of Ψ
    comm_theory_psi: Optional[float]  # what the ZeRO paper's formula says (None: no formula applies)
    # per rank: peak RSS, measured, analytic_* (ZeRO paper) and predicted_* (parallel_lab.plan, exact)
    # model-state bytes, comm by op; with trainer.profile, time_ms (the mean profiled step's step,
    # compute, comm, exposed_comm, optimizer, idle, other in ms), time_ms_steps (each profiled step's)
    # and comm_overlap (1 - exposed_comm / comm): parallel_lab/worker/timeline.py, docs/profiling.md
    ranks: list[dict]
    strategy_options: dict  # the validated strategy.* options
    strategy_extras: dict[str, Any] = field(default_factory=dict)  # Strategy.extra_metrics(), by name
    nodes: Optional[int] = None  # hosts the ranks ran on (launcher.nodes as resolved; None: an older run)
    nproc_per_node: Optional[int] = None  # ranks per host
    # the busiest rank's bytes per step on process groups spanning hosts (parallel_lab/comm/placement.py)
    inter_host_bytes_per_step: Optional[float] = None
    # how the ranks started: "fork" (launcher=spawn on CPU: forked from an interpreter that had
    # already imported torch, parallel_lab/worker/zygote.py) or "exec" (a fresh interpreter each)
    rank_start: Optional[str] = None
    device_name: Optional[str] = None  # the GPU's name on CUDA (torch.cuda.get_device_name); None on CPU
    # set: a noise-floor rerun of the baseline, labelled by its perturbation (report/parity.py noise_reruns)
    noise_rerun: Optional[str] = None
    # The kernel libraries' instruction-set settings the run had (KERNEL_DISPATCH_VARS that were set;
    # empty: each library chose from the CPU). With cpu_capability, what decided the floats (docs/facts.md).
    kernel_dispatch: dict[str, str] = field(default_factory=dict)
    norm: str = "group"  # model.norm: group | batch | syncbatch (docs/batchnorm.md)
    recompute: str = "none"  # trainer.recompute: none | selective | full (models/recompute.py)
    moe_experts: int = 0  # model.moe_experts (0: a dense model; docs/moe.md): the report's label of its rows
    # BatchNorm models only ({} otherwise; parallel_lab/worker/train.py batchnorm_record): layers,
    # synced, samples (how many samples each training forward normalised over), the running
    # statistics' replica check at the end, and SyncBatchNorm's bytes per step measured vs theory.
    batchnorm: dict[str, Any] = field(default_factory=dict)
    # The replica check (parallel_lab/worker/replicas.py): True when every data-parallel replica of
    # every parameter ended bit for bit equal, False naming the groups of ranks that differ,
    # None when no two ranks hold the same parameter (world 1, untied pure pp, flat FSDP, fsdp x cp, ZeRO-3)
    replica_digests_agree: Optional[bool] = None
    replica_groups: list = field(default_factory=list)  # the rank groups compared (each a list of ranks)
    replica_groups_disagree: list = field(default_factory=list)  # [{ranks, params (the first), count}]
    # trainer.profile only ({} otherwise): the profiled steps, the loop's step time in them and in the
    # other steps after warm-up (the profiler's cost), and the traces' folder (parallel_lab/worker/profile.py)
    profile: dict[str, Any] = field(default_factory=dict)
    # trainer.reshard=true: the run the checkpoint came from ({strategy, strategy_options,
    # world_size, step, format}); None when not resharded
    resharded_from: Optional[dict[str, Any]] = None
    # trainer.init_from: {path, format, optimizer} of the outside weights this run started from
    initialized_from: Optional[dict[str, Any]] = None
    # [{from_step, to_step, world_size, strategy}]: steps [from, to) trained at that world (one range
    # unless an elastic run, launcher.min_nodes, lost or regained hosts, or a reshard changed it)
    world_size_history: list = field(default_factory=list)
    # {"start": {...}, "end": {...}} of rank 0: the 1/5/15-minute load averages and the CPUs' mean
    # clock in MHz (None where the machine does not say): parallel_lab/worker/metrics.py machine_state
    machine: dict[str, Any] = field(default_factory=dict)
    # the model FLOPs of one step on the global batch (forward x 3; worker/metrics.py model_flops_per_step)
    model_flops_per_step: Optional[float] = None
    # the same split by the kernel that runs it, {"conv": F, "matmul": F} (worker/metrics.py
    # model_flops_by_kind): MFU's peak weights each kernel's measured peak by it
    model_flops_by_kind: Optional[dict[str, float]] = None
    warmup_steps: Optional[int] = None  # steps left out of the timing (None: a record from before it was kept)
    # where comm_theory_psi is None: rank 0's planned bytes per step in Ψ (plan/predict.py
    # planned_comm_psi), the report's "comm Ψ theory" for tp and pp (None: no prediction, or an older run)
    comm_planned_psi: Optional[float] = None


# ATen's, oneDNN's (convolutions) and MKL's (matrix products) instruction-set switches
KERNEL_DISPATCH_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def kernel_dispatch() -> dict[str, str]:
    """This process's settings of KERNEL_DISPATCH_VARS (the ones set)."""
    return {name: os.environ[name] for name in KERNEL_DISPATCH_VARS if name in os.environ}


def save_final_params(run_dir: Path, names: list[str], params: list) -> None:
    """<run_dir>/final_params.pt: every full parameter by its single-model name, fp32 on CPU, so
    the report can measure the distance between two runs' weights (not only their sums)."""
    import torch

    if len(names) != len(params):
        raise RuntimeError(f"full_parameters() returned {len(params)} tensors for {len(names)} parameters")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (PARAMS_FILE + ".tmp")
    torch.save({n: p.detach().float().cpu().contiguous() for n, p in zip(names, params)}, tmp)
    os.replace(tmp, run_dir / PARAMS_FILE)


def load_final_params(run_dir: Path) -> dict | None:
    """Another run's final_params.pt (tensors only: ``weights_only``), None if it wrote none."""
    import torch

    path = Path(run_dir) / PARAMS_FILE
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
