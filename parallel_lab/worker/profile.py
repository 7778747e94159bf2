"""``trainer.profile=true``: a torch.profiler trace of ``trainer.profile_steps`` steps right after
the warm-up steps, on every rank, written to ``<run_dir>/traces/rank<k>.json`` (Chrome trace format:
Perfetto and chrome://tracing open it), then read back into ``ranks[k].time_ms``
(``parallel_lab.worker.timeline``).

A run without profiling builds no profiler, opens no range and installs no wrapper: the loop's
ranges are ``contextlib.nullcontext`` and the communication counter's labels stay off.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
from omegaconf import DictConfig

from parallel_lab.comm.counter import CommCounter, labelled_waits
from parallel_lab.comm.dist_env import DistEnv
from parallel_lab.protocol import trace_path
from parallel_lab.worker import timeline


def no_range(name: str) -> contextlib.AbstractContextManager:
    """The loop's ranges in a run that is not profiled: nothing."""
    return contextlib.nullcontext()


class StepProfiler:
    """Records steps [warmup_steps, warmup_steps + profile_steps) of this rank and analyses them."""

    def __init__(self, cfg: DictConfig, env: DistEnv, counter: CommCounter) -> None:
        self.first = cfg.trainer.warmup_steps
        self.last = self.first + cfg.trainer.profile_steps  # exclusive
        self.path = trace_path(cfg.run_dir, env.rank)
        self.counter = counter
        self.cuda = env.device.type == "cuda"
        self._prof: torch.profiler.profile | None = None
        self._waits = contextlib.ExitStack()
        self.steps: list[dict[str, float]] = []
        self.gpu_steps: list[dict[str, float]] = []

    @classmethod
    def maybe(cls, cfg: DictConfig, env: DistEnv, counter: CommCounter) -> StepProfiler | None:
        return cls(cfg, env, counter) if cfg.trainer.get("profile") else None

    def region(self, name: str) -> contextlib.AbstractContextManager:
        """A named range while recording (the loop's step and optimizer), else nothing."""
        return torch.profiler.record_function(name) if self._prof is not None else contextlib.nullcontext()

    def profiled(self, step: int) -> bool:
        return self.first <= step < self.last

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Every thread, not only this one: manual_ddp's communication thread, DeepSpeed's and
        # gloo's workers issue the collectives whose overlap the trace is for.
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        self._prof = torch.profiler.profile(activities=activities, experimental_config=config)
        self._prof.start()
        self.counter.profiling = True
        self._waits.enter_context(labelled_waits())

    def after_step(self, step: int) -> None:
        if step != self.last - 1 or self._prof is None:
            return
        self._waits.close()
        self.counter.profiling = False
        self._prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        events = timeline.load_events(self.path)
        self.steps = timeline.breakdown(events)
        self.gpu_steps = timeline.gpu_breakdown(events)

    def rank_record(self, step_times: list[float]) -> dict:
        """What this rank adds to its entry of metrics.json's ranks: the trace's breakdown and, beside
        it, this rank's own loop timing of the same steps (the check that the parts add up)."""
        time_ms = timeline.mean_breakdown(self.steps)
        record = {
            "time_ms": time_ms,
            "time_ms_steps": self.steps,
            "comm_overlap": timeline.overlap(time_ms),
            "loop_step_ms": [1000 * t for i, t in enumerate(step_times) if self.profiled(i)],
        }
        if self.gpu_steps:
            record["gpu_time_ms"] = timeline.mean_breakdown(self.gpu_steps)
        return record

    def run_record(self, step_times: list[float], warmup: int) -> dict:
        """metrics.json's ``profile``: which steps were traced and the loop's own step time in them
        and in the other steps after warm-up (their ratio is the profiler's cost)."""
        traced = [t for i, t in enumerate(step_times) if self.profiled(i)]
        rest = [t for i, t in enumerate(step_times) if i >= warmup and not self.profiled(i)]
        return {
            "steps": list(range(self.first, self.last)),
            "traces": str(self.path.parent),
            "profiled_step_s": statistics.median(traced) if traced else None,
            "unprofiled_step_s": statistics.median(rest) if rest else None,
            "loop_step_s": traced,  # the loop's timing of each traced step, beside the trace's own
        }
