"""Deliberate failures (``fault.*``), to see what a crash does to a run and its checkpoints."""

from __future__ import annotations

import os
import signal

from omegaconf import DictConfig

from parallel_lab.comm.dist_env import DistEnv


class InjectedFault(RuntimeError):
    """Raised by ``fault.rank``/``fault.step`` to test how a run fails."""


def maybe_inject_fault(fault: DictConfig, env: DistEnv, step: int, at: str) -> None:
    """Fail as fault.* asks, only in the first attempt (a torchrun restart must be able to finish)."""
    if fault.rank != env.rank or fault.step != step or fault.at != at or env.restart_count > 0:
        return
    if fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault on rank {env.rank} at {at} {step} (fault.rank={env.rank} fault.step={step})")
