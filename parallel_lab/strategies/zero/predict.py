"""What DeepSpeed ZeRO (0.19.8, fp32, no offload) will hold and send, from the model's shapes
alone (``parallel_lab.plan``). Read from ``deepspeed/runtime/zero/stage_1_and_2.py`` and
``stage3.py`` and checked against the measured bytes of real runs (docs/plan.md).

Stages 1 and 2 (``DeepSpeedZeroOptimizer``): all parameters of the (one) group are flattened into
one buffer padded to a multiple of 2N elements (``nccl_start_alignment_factor`` 2 x world size;
per-parameter alignment is off by default), and the buffer is cut into N equal partitions with no
regard for parameter boundaries, so a partition boundary can cut through a parameter. Per rank:

- parameters: the whole flat buffer (the module's parameters are views into it);
- master: an fp32 *clone* of its partition (a separate copy even in fp32);
- optimizer: torch's state for that flat partition (Adam: two moments, step not counted);
- gradients, stage 1: every parameter's whole gradient until the one reduction at the boundary;
  stage 2: the whole gradient of every parameter that overlaps its partition (a parameter cut by
  the boundary is kept whole on both sides) plus the padding that falls in its partition.

Stage 3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is padded to a multiple of N and
split into N equal pieces; parameters, gradients (``grad_partitions_flat_buffer``) and the fp32
master each hold sum(ceil(numel/N)) elements per rank, the optimizer two moments of it.
Stage 0: plain data parallel with the torch optimizer (its state: two moments per parameter).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from parallel_lab.strategies.memory import optimizer_bytes_per_param

ALIGNMENT_PER_RANK = 2  # deepspeed stage_1_and_2: nccl_start_alignment_factor


def flat_partition(numels: list[int], world: int) -> tuple[int, int]:
    """(padded flat numel, partition numel) of stages 1-2's flat buffer."""
    total = sum(numels)
    align = ALIGNMENT_PER_RANK * world
    padded = -(-total // align) * align
    return padded, padded // world


def stage2_grad_numel(numels: list[int], world: int, rank: int) -> int:
    """Elements of gradient a stage-2 rank holds after backward: every parameter overlapping its
    partition, whole, plus the flat buffer's padding inside its partition."""
    padded, part = flat_partition(numels, world)
    lo, hi = rank * part, (rank + 1) * part
    held, start = 0, 0
    for n in numels:
        if start < hi and start + n > lo:
            held += n
        start += n
    return held + max(0, min(hi, padded) - max(lo, sum(numels)))


def predict_zero_memory(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
    opts = cfg.strategy
    if opts.precision != "fp32" or opts.offload != "none":
        return None  # only fp32 without offload is traced and checked
    numels = [p.numel() for p in model.parameters()]
    world, stage, k = cfg.world_size, opts.stage, optimizer_bytes_per_param(cfg.trainer)
    total = sum(numels)
    if stage == 0:
        return {
            "param_bytes": 4 * total,
            "master_param_bytes": 0,
            "grad_bytes": 4 * total,
            "optim_bytes": k * total,
            "comm_buffer_bytes": 0,
        }
    if stage == 3:
        part = sum(-(-n // world) for n in numels)
        return {
            "param_bytes": 4 * part,
            "master_param_bytes": 4 * part,
            "grad_bytes": 4 * part,
            "optim_bytes": k * part,
            "comm_buffer_bytes": 0,
        }
    padded, part = flat_partition(numels, world)
    grads = total if stage == 1 else stage2_grad_numel(numels, world, rank)
    return {
        "param_bytes": 4 * padded,
        "master_param_bytes": 4 * part,
        "grad_bytes": 4 * grads,
        "optim_bytes": k * part,
        "comm_buffer_bytes": 0,
    }


def predict_zero_comm(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
    """Counted on gloo: stages 0-2 all-reduce every gradient (stages 1-2 then all-gather the
    updated flat partitions); stage 3 all-gathers each parameter for forward and again for
    backward (first step; later steps reuse gathered parameters of small models) and
    reduce-scatters the gradients. A few scalar collectives (8-16 bytes) are left out."""
    if cfg.strategy.precision != "fp32":
        return None
    if cfg.world_size < 2:
        return {}
    numels = [p.numel() for p in model.parameters()]
    world, stage = cfg.world_size, cfg.strategy.stage
    if stage == 3:
        full = 4.0 * sum(-(-n // world) for n in numels) * world
        return {"all_gather_single": 2 * full, "reduce_scatter_single": full}
    comm = {"all_reduce": 2.0 * 4 * sum(numels)}
    if stage >= 1:
        comm["all_gather_single"] = 4.0 * flat_partition(numels, world)[0]
    return comm
