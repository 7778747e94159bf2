"""Parent-side rules of ``strategy=pp strategy.impl=deepspeed`` (its refusals) and the DeepSpeed
config it runs, apart from ``ds_pipe.py`` so that ``rules.py`` needs nothing of the strategy."""

from __future__ import annotations

from omegaconf import DictConfig


def pipe_ds_config(cfg: DictConfig) -> dict:
    """The DeepSpeed config of a pipeline run, every batch setting from ``trainer.*``."""
    t, opts = cfg.trainer, cfg.strategy
    accumulation = opts.microbatches * t.grad_accum
    return {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.global_batch // (opts.replicate * accumulation),
        "gradient_accumulation_steps": accumulation,
        # Off (DeepSpeed's default is 1.0): its clip would leave later stages' gradients out of the
        # norm (docs/facts.md); ds_pipe.py runs the pp strategy's own clip before the optimizer step.
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def check_deepspeed_pipe(opts: DictConfig, cfg: DictConfig) -> None:
    """The parent's refusals for ``strategy.impl=deepspeed`` (ConfigError, one line)."""
    import importlib.util

    from parallel_lab.errors import ConfigError

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "strategy.impl=deepspeed needs DeepSpeed, which is not installed; pip install deepspeed (make installs "
            "it), or use strategy.impl=manual"
        )
