"""What DeepSpeed ZeRO (0.19.8) will hold and send, from the model's shapes alone
(``parallel_lab.plan``), in every precision (fp32, bf16; fp16 on a GPU, the same 16-bit layout) and
with or without ``strategy.offload=cpu``. Read from ``deepspeed/runtime/zero/stage_1_and_2.py``,
``stage3.py``, ``fp16/unfused_optimizer.py`` and ``engine.py``, and checked to the byte against
the measured buffers of real runs (docs/plan.md, docs/zero.md).

w is the bytes of a model weight (4 in fp32, 2 in bf16/fp16), k the optimizer's fp32 state per
element (Adam 8, SGD with momentum 4), N the world size.

Stages 1 and 2 (``DeepSpeedZeroOptimizer``): all parameters of the (one) group are flattened into
one w-byte buffer padded to a multiple of 2N elements (``nccl_start_alignment_factor`` 2 x world
size; per-parameter alignment is off by default), cut into N equal partitions with no regard for
parameter boundaries, so a partition boundary can cut through a parameter. Per rank:

- parameters: the whole flat buffer (the module's parameters are views into it);
- master: an fp32 *clone* of its partition (a separate copy even in fp32);
- optimizer: torch's state for that flat partition (Adam: two moments, step not counted);
- gradients, stage 1: every parameter's whole gradient (w bytes) until the one reduction at the
  boundary; stage 2: the whole gradient of every parameter that overlaps its partition (a
  parameter cut by the boundary is kept whole on both sides) plus the padding in its partition;
- offload: DeepSpeed allocates the fp32 master's gradient (4 bytes x partition) at init and keeps
  it: stage 1 holds it beside the whole 16/32-bit gradients; stage 2 copies each reduced gradient
  straight into it and keeps nothing else after backward;
- comm buffers: the reduction bucket, ``reduce_bucket_size`` elements of w bytes (two with
  overlap_comm), allocated for backward when gradients are contiguous (stage 2's default, and
  always with offload; our stage 1 turns it off); offload adds two staging gradients of the
  largest parameter and a w-byte copy of the partition.

Stage 3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is padded to a multiple of N and split
into N equal pieces: parameters (w), gradients (``grad_partitions_flat_buffer``, w) and the fp32
master each hold sum(ceil(numel/N)) elements per rank, the optimizer k bytes of each; offload adds
the fp32 master's gradient (4 bytes each, kept from init); the reduction bucket (one, w bytes x
``reduce_bucket_size``) lives for the whole run.

Stage 0: in fp32 plain data parallel with the torch optimizer. In bf16/fp16 the module is 16-bit and
DeepSpeed's ``FP16_UnfusedOptimizer`` keeps an fp32 copy of every parameter (4Ψ, not partitioned)
that torch's optimizer updates: 2Ψ parameters + 4Ψ master + 2Ψ gradients + 8Ψ Adam, the paper's
16Ψ mixed-precision baseline.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from parallel_lab.optim import optimizer_bytes_per_param
from parallel_lab.strategies.cp.rules import add_comm
from parallel_lab.strategies.ep.rules import ep_degree, expert_ids, local_expert_numels
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.zero.ds_config import DTYPE_BYTES

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


def stage3_partition_numel(numels: list[int], world: int) -> int:
    """Elements of every stage-3 partition a rank holds (each parameter padded to a multiple of N)."""
    return sum(-(-n // world) for n in numels)


def zero_settings(cfg: DictConfig) -> dict | None:
    """The ZeRO settings that shape the buffers, as DeepSpeed will see them (the generated
    ds_config, a user's strategy.ds_config included, DeepSpeed's defaults for what neither sets);
    None where the layout is not the one this module follows: a file asking for fp32 gradient
    accumulation (BF16_Optimizer) or for stage-3 parameters kept whole below a size."""
    from parallel_lab.strategies.zero.ds_config import build_ds_config

    opts = cfg.strategy
    ds = build_ds_config(cfg, opts)
    if opts.get("ds_config") and not isinstance(cfg, DictConfig):
        # the planner's plain-values config: its "auto"s as the parent resolved them (config.yaml's ds_auto)
        from parallel_lab.strategies.zero.ds_auto import apply_ds_auto

        ds = apply_ds_auto(ds, (cfg.get("ds_auto") or {}).get("strategy.ds_config"))
    zero = ds.get("zero_optimization") or {}
    w = DTYPE_BYTES[opts.precision]
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if accum is not None and DTYPE_BYTES.get(str(accum)) != w:
        return None
    if opts.stage == 3 and zero.get("stage3_param_persistence_threshold", 0):
        return None
    comm = ds.get("communication_data_type")
    overlap = zero.get("overlap_comm", opts.stage == 3)
    contiguous = zero.get("contiguous_gradients", True)
    bucket = zero.get("reduce_bucket_size", 500_000_000)  # DeepSpeed's default
    if not (isinstance(bucket, (int, float)) and isinstance(overlap, bool) and isinstance(contiguous, bool)):
        return None  # an "auto" the planner's plain config has not resolved (a run's has: config.yaml's ds_auto)
    return {
        "w": w,
        "comm_bytes": DTYPE_BYTES.get(str(comm), w) if comm else w,
        "reduce_bucket_size": int(bucket),
        "contiguous_gradients": contiguous,
        "overlap_comm": overlap,
        "offload": opts.offload != "none",
    }


def zero_groups(cfg: DictConfig, model: torch.nn.Module, rank: int) -> list[tuple[list[int], int, int]]:
    """Each flat group of stages 1-2: (its element counts, the ranks it is partitioned over, this
    rank's place among them). One group of every parameter over the world; under strategy.ep the
    dense parameters over the world and this rank's experts over their expert-data-parallel group
    (ranks rank % ep, rank % ep + ep, ...: DeepSpeed's ``_create_expert_and_data_parallel``), as
    ``split_params_into_different_moe_groups_for_optimizer`` groups them (ds_moe.py)."""
    ep = ep_degree(cfg)
    if ep == 1:
        return [([p.numel() for p in model.parameters()], cfg.world_size, rank)]
    experts = expert_ids(model)
    dense = [p.numel() for p in model.parameters() if id(p) not in experts]
    local = local_expert_numels(MeshDims(replicate=cfg.world_size, ep=ep), model, rank)
    return expert_flat_groups(dense, local, cfg.world_size, rank, ep)


def expert_flat_groups(dense: list[int], local: list[int], world: int, rank: int, ep: int) -> list[tuple]:
    """Under strategy.ep: the dense parameters partitioned over the world, this rank's experts over
    their expert-data-parallel group of world / ep ranks, where this rank is rank // ep."""
    return [(dense, world, rank), (local, world // ep, rank // ep)]


def predict_zero_memory(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
    s = zero_settings(cfg)
    if s is None:
        return None
    groups = zero_groups(cfg, model, rank)
    numels = [n for group, _, _ in groups for n in group]
    world, stage, k = cfg.world_size, cfg.strategy.stage, optimizer_bytes_per_param(cfg.trainer)
    w, offload = s["w"], s["offload"]
    total = sum(numels)
    if stage == 0:
        # 16-bit: FP16_UnfusedOptimizer's fp32 copy of every parameter is the master
        return {
            "param_bytes": w * total,
            "master_param_bytes": 0 if w == 4 else 4 * total,
            "grad_bytes": w * total,
            "optim_bytes": k * total,
            "comm_buffer_bytes": 0,
        }
    if stage == 3:
        part = stage3_partition_numel(numels, world)
        return {
            "param_bytes": w * part,
            "master_param_bytes": 4 * part,
            "grad_bytes": w * part + (4 * part if offload else 0),
            "optim_bytes": k * part,
            "comm_buffer_bytes": s["reduce_bucket_size"] * s["comm_bytes"] if s["contiguous_gradients"] else 0,
        }
    padded = sum(flat_partition(group, ways)[0] for group, ways, _ in groups)
    part = sum(flat_partition(group, ways)[1] for group, ways, _ in groups)
    if stage == 1:
        grads = w * total + (4 * part if offload else 0)
    else:
        held = sum(stage2_grad_numel(group, ways, place) for group, ways, place in groups)
        grads = 4 * part if offload else w * held
    buckets = 0
    if s["contiguous_gradients"] or offload:  # stage_1_and_2: contiguous_gradients or cpu_offload
        buckets = s["reduce_bucket_size"] * w * (2 if s["overlap_comm"] else 1)
    staging = (2 * max(numels, default=0) + part) * w if offload else 0
    return {
        "param_bytes": w * padded,
        "master_param_bytes": 4 * part,
        "grad_bytes": grads,
        "optim_bytes": k * part,
        "comm_buffer_bytes": buckets + staging,
    }


def predict_zero_comm(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
    """Counted on gloo: stages 0-2 all-reduce every gradient (stages 1-2 then all-gather the
    updated flat partitions); stage 3 all-gathers each parameter for forward and again for
    backward (first step; later steps reuse gathered parameters of small models) and
    reduce-scatters the gradients. 16-bit runs reduce and gather 16-bit tensors (half the bytes);
    offload moves the same. A few scalar collectives (8-16 bytes) are left out."""
    s = zero_settings(cfg)
    if s is None:
        return None
    if cfg.world_size < 2:
        return {}
    world, stage, w, c = cfg.world_size, cfg.strategy.stage, s["w"], s["comm_bytes"]
    if stage == 3:
        numels = [p.numel() for p in model.parameters()]
        full = stage3_partition_numel(numels, world) * world
        return {"all_gather_single": 2.0 * w * full, "reduce_scatter_single": float(c * full)}
    comm = zero_group_comm(stage, zero_groups(cfg, model, rank), w, c, cfg.trainer.grad_accum)
    if ep_degree(cfg) == 1:
        return comm
    micro = cfg.trainer.global_batch // (world * cfg.trainer.grad_accum)
    return add_comm(comm, deepspeed_moe_comm(cfg, model, micro))


def zero_group_comm(
    stage: int, groups: list[tuple[list[int], int, int]], w: int, c: int, micro_batches: int = 1
) -> dict[str, float]:
    """Stages 0-2, counted on gloo: every group's gradients all-reduced over its ranks (DeepSpeed
    calls it on a group of one rank too: counted, nothing moves), at stage 2 once per micro-batch
    (its hooks reduce each bucket in every backward; stages 0-1 once, at the boundary: measured
    with trainer.grad_accum=2, with and without ep); stages 1-2 all-gather the updated partitions
    of each group partitioned over more than one rank."""
    reductions = micro_batches if stage == 2 else 1
    comm = {"all_reduce": sum(2.0 * c * reductions * sum(group) for group, _, _ in groups)}
    if stage >= 1:
        comm["all_gather_single"] = sum(float(w * flat_partition(g, ways)[0]) for g, ways, _ in groups if ways > 1)
    return comm


def deepspeed_moe_comm(cfg: DictConfig, model: torch.nn.Module, micro_batch: int) -> dict[str, float]:
    """Bytes per step per rank of DeepSpeed's MoE layer with every expert equally loaded (ds_moe.py):
    per MoE layer and sample, four all-to-alls (dispatch, combine, and both again in backward) of
    its E x C x h fp32 buffer, C = ceil(k x S / E), and the capacity's all-reduce (one int64)."""
    from parallel_lab.strategies.ep.rules import _moe_layers, _tokens

    samples = micro_batch * cfg.trainer.grad_accum
    out = {"all_to_all_single": 0.0, "all_reduce": 0.0}
    for moe in _moe_layers(model):
        per_expert = -(-moe.topk * _tokens(cfg) // moe.num_experts)
        out["all_to_all_single"] += samples * 4 * moe.num_experts * per_expert * moe.router.in_features * 4
        out["all_reduce"] += samples * 2 * 8
    return out
