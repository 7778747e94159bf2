"""DeepSpeed's activation checkpointing (``deepspeed.checkpointing``) for the DeepSpeed strategies
(zero0-3, ``strategy=pp strategy.impl=deepspeed``) when ``trainer.recompute`` is not none.

``ds_checkpoint_function(ds_config)`` configures DeepSpeed's checkpointing from the config's
``activation_checkpointing`` section (DeepSpeed's own parser, ``DeepSpeedActivationCheckpointingConfig``:
partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints,
synchronize_checkpoint_boundary, profile) and returns ``deepspeed.checkpointing.checkpoint``:
``checkpoint(function, *tensors)`` runs ``function`` without keeping its activations and runs it
again in backward, restoring the RNG state first (DeepSpeed's ``CheckpointFunction``).

Without a model-parallel unit ``partition_activations`` has nothing to partition over: it is
refused (``ds_checkpoint_refusal``), as is ``contiguous_memory_optimization``, which DeepSpeed
allows only with partitioned activations. Where it plugs in: docs/deepspeed_parallel.md.
"""

from __future__ import annotations

from typing import Callable

CheckpointFunction = Callable[..., object]  # checkpoint(function, *args) -> function(*args), recomputed in backward


def ds_checkpoint_refusal(ds_config: dict) -> str | None:
    """Why this config's activation_checkpointing section cannot run here (one line), or None."""
    section = ds_config.get("activation_checkpointing") or {}
    for key in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing"):
        if section.get(key):
            return (
                f"activation_checkpointing.{key}=true partitions activations over a model-parallel group, which "
                f"the zero and pp strategies do not hand DeepSpeed; set it to false"
            )
    return None


def ds_checkpoint_function(ds_config: dict) -> CheckpointFunction:
    """DeepSpeed's checkpoint function, configured from ``ds_config["activation_checkpointing"]``."""
    import importlib

    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    refusal = ds_checkpoint_refusal(ds_config)
    if refusal:
        raise ValueError(refusal)
    # By module name: deepspeed.checkpointing is re-exported, the module holds the settings.
    checkpointing = importlib.import_module("deepspeed.runtime.activation_checkpointing.checkpointing")
    section = DeepSpeedActivationCheckpointingConfig(ds_config)  # DeepSpeed's parser and defaults
    checkpointing.configure(
        None,  # no model-parallel unit: nothing is partitioned
        partition_activations=section.partition_activations,
        contiguous_checkpointing=section.contiguous_memory_optimization,
        num_checkpoints=section.number_checkpoints,
        checkpoint_in_cpu=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile,
    )
    return checkpointing.checkpoint
