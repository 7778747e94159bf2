"""What the parent and its workers agree on: the files of a run folder and the environment.

The parent (``parallel_lab.cli``) writes ``config.yaml`` and reads what the workers leave; the
workers (``parallel_lab.worker``) read ``config.yaml`` and write the rest. Both sides import these
names from here, so neither imports the other.

    <run_dir>/config.yaml          the resolved config (parent)
    <run_dir>/metrics.json         rank 0, on success only
    <run_dir>/failed.json          the parent, when a run failed (never beside metrics.json)
    <run_dir>/final_params.pt      rank 0: the full final parameters, for the parity check
    <run_dir>/errors/rank<k>.txt   a failed rank's one-line summary and traceback
    <run_dir>/pids/rank<k>.pid     every worker's pid, to check none outlived the run
    <run_dir>/checkpoints/         the default trainer.checkpoint_dir
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.json"
FAILED_FILE = "failed.json"
PARAMS_FILE = "final_params.pt"  # the full (gathered) final parameters, by name: parity compares these
ERRORS_DIR = "errors"
PIDS_DIR = "pids"
CHECKPOINTS_DIR = "checkpoints"
SUPERVISED_ENV = "PARALLEL_LAB_SUPERVISED"  # set by our launcher: it prints the traceback itself


def default_checkpoint_dir(run_dir: str | Path) -> Path:
    """Where checkpoints go when trainer.checkpoint_dir is not set."""
    return Path(run_dir) / CHECKPOINTS_DIR


def set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends sig to this process when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
