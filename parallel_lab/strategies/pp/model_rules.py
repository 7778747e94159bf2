"""What ``pp`` refuses of the precision, per ``strategy.impl``: bf16 on our chunks (manual, torch),
backward whole. Tied embeddings run under every impl (the last stage's copy of the embedding,
its gradient summed with the first's: pp/tied.py; deepspeed: its engine's tied-gradient all-reduce,
pp/ds_pipe.py). Torch-free (the parent reads it before any process starts)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError


def check_bf16(opts: DictConfig) -> None:
    """bf16 runs in our chunks (tp-split or not) under the manual loop or torch's schedules, backward
    not split into B and W; DeepSpeed's engine would run its own bf16 optimizer, not our copies."""
    bad = {"impl": str(opts.impl) not in ("manual", "torch"), "schedule": opts.schedule == "zero_bubble"}
    for key in [k for k, v in bad.items() if v and opts.get("precision", "fp32") == "bf16"][:1]:
        raise ConfigError(
            f"strategy.precision=bf16 with strategy=pp strategy.{key}={opts[key]}: bf16 runs on our chunks "
            f"(manual loop or torch's schedules), backward whole; use strategy.{key}="
            f"{dict(impl='manual', schedule='1f1b')[key]} or strategy.precision=fp32"
        )
