"""What ``pp`` refuses of the model's ties and the precision, per ``strategy.impl``: tied embeddings
run where the last stage's copy of the embedding is in its chunk and our optimizer step sums its
gradient with the first's (pp/tied.py: manual, torch); bf16 on our chunks (manual, torch),
backward whole. Torch-free (the parent reads it before any process starts)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.pp.chunks import ties_across_stages

# why an impl cannot tie the embedding across its stages (manual and torch: the stage's copy is in
# its last chunk, the all-reduce in our optimizer step, pp/tied.py)
TIED_REASONS = {
    "deepspeed": "DeepSpeed's PipelineModule ties weights only through its own TiedLayerSpec, which "
    "pp/ds_pipe.py does not build",
}


def check_tied(opts: DictConfig, cfg: DictConfig) -> None:
    """model.tied=true over several stages: where our step sums the copies' gradients (pp/tied.py)."""
    impl = str(opts.impl)
    if ties_across_stages(cfg) and impl in TIED_REASONS:
        raise ConfigError(
            f"strategy=pp strategy.impl={impl} with model.tied=true: {TIED_REASONS[impl]}; use "
            "strategy.impl=manual or torch (the last stage keeps a copy of the embedding, gradients summed) or "
            "model.tied=false"
        )


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
