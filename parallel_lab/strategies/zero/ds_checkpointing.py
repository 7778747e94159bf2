"""DeepSpeed's activation checkpointing (``deepspeed.checkpointing``) for the DeepSpeed strategies
(zero0-3, ``strategy=pp strategy.impl=deepspeed``) when ``trainer.recompute`` is not none.

``ds_checkpoint_function(ds_config)`` configures DeepSpeed's checkpointing from the config's
``activation_checkpointing`` section (DeepSpeed's own parser, ``DeepSpeedActivationCheckpointingConfig``:
partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints,
synchronize_checkpoint_boundary, profile) and returns DeepSpeed's non-reentrant checkpoint
(``deepspeed.checkpointing.non_reentrant_checkpoint``, the one ``pipeline.use_reentrant=false`` picks
for DeepSpeed's own pipeline): ``checkpoint(function, *tensors)`` runs ``function`` without keeping
its activations and runs it again in backward, restoring the RNG state first.

Non-reentrant, as torch's checkpoint is for every other strategy (models/recompute.py): the
recomputed region's gradients flow through autograd's own graph, in the layout the region's
backward gives them. The reentrant ``deepspeed.checkpointing.checkpoint`` hands its inputs' gradients
back as the leaves' ``.grad`` instead, which autograd lays out like the input (its layout contract),
not like the matmul backward that made them: the vit's k leaves ``q @ k.transpose(-2, -1)``'s backward
transposed. Under ZeRO-3, DeepSpeed's linear (``LinearFunctionForZeroStage3``) sums the bias gradient
in that tensor's memory order, so k.bias's gradient (zero up to rounding: softmax ignores a per-query
constant) got other rounding noise, which Adam scales up to a step (measured: 1.8e-5; then 63 of the
vit's 71 tensors 1 ulp off) on every CPU: trainer.recompute=selective was not bit for bit under zero3.

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
    return checkpointing.non_reentrant_checkpoint
