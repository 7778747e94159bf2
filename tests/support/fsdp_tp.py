"""What 2-D FSDP2 x TP (x CP) and HSDP x CP (``hsdp_bytes``) hold and send on each rank of the vit,
derived here from the vit's parameter shapes and the two papers' layouts, independently of the
planner (parallel_lab/strategies/fsdp/predict.py): Megatron's split (Shoeybi et al., arXiv
1909.08053) cuts the column layers' weight and bias on dim 0 and the row layers' weight on dim 1
over tp; fully_shard then cuts each tp-local tensor on its dim 0 over the D = world / tp ranks of
one tp coordinate (torch.chunk's rows, every shard padded to ceil(rows / D)). Used by
tests/unit/test_tensor_parallel.py (the plan), tests/support/bodies/cp_vit.py and
tests/integration/test_tp_vit.py (the measured runs)."""

from __future__ import annotations

import math

COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.fc1")  # a vit block's column-parallel layers
ROW = ("attn.proj", "mlp.fc2")  # its row-parallel layers (the bias stays whole)


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape tp rank holds of parameter ``name`` (the vit's dims divide by tp)."""
    layer, _, kind = name.rpartition(".")
    within = layer.partition(".")[2] if layer.startswith("block") else ""
    dim = 0 if within in COLUMN else 1 if within in ROW and kind == "weight" else None
    if dim is None:
        return tuple(shape)
    assert shape[dim] % tp == 0, (name, shape, tp)
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def fsdp_tp_state(named_shapes: dict[str, tuple[int, ...]], world: int, tp: int, rank: int) -> dict[str, int]:
    """Model state bytes of ``rank`` (fp32, Adam): parameters and gradients the padded shards,
    Adam's two moments the rows the rank really holds."""
    shards, rank_in = world // tp, rank // tp  # tp innermost in the layout
    padded = held = 0
    for name, shape in named_shapes.items():
        local = tp_local_shape(name, shape, tp)
        rows, rest = local[0], math.prod(local[1:])
        per = -(-rows // shards)
        padded += per * rest
        held += max(0, min(rows, (rank_in + 1) * per) - rank_in * per) * rest
    return {"param_bytes": 4 * padded, "grad_bytes": 4 * padded, "optim_bytes": 8 * held}


def fsdp_tp_bytes(
    named_shapes: dict[str, tuple[int, ...]],
    world: int,
    tp: int,
    cp: int,
    batch: int,
    tokens: int,
    dim: int,
    accum: int = 1,
) -> dict[str, float]:
    """Bytes a rank issues in one step of ``accum`` micro-batches (comm/counter.py's units: an
    all-gather its output, a reduce-scatter its input, an all-reduce twice its bytes), each
    micro-batch's: every padded shard all-gathered twice (forward, backward) and reduce-scattered
    once over the D ranks (FSDP2 syncs at every backward); per block Megatron's 2 forward and 2
    backward all-reduces of one (batch, tokens/cp, dim) fp32 activation, batch the samples of one
    data-parallel rank's micro-batch. Context parallelism's own bytes: cp_vit.py cp_bytes."""
    shards = world // tp
    padded = fsdp_tp_state(named_shapes, world, tp, 0)["param_bytes"]  # the same on every rank
    depth = len({name.partition(".")[0] for name in named_shapes if name.startswith("block")})
    activation = batch * (tokens // cp) * dim * 4
    return {
        "all_gather_single": accum * 2.0 * shards * padded,
        "reduce_scatter_single": accum * 1.0 * shards * padded,
        "all_reduce": accum * depth * 4 * 2.0 * activation,
    }


def hsdp_bytes(named_shapes: dict[str, tuple[int, ...]], shards: int, accum: int = 1) -> dict[str, float]:
    """HSDP's bytes a rank issues in one step (the counter's units), fully_shard over the ``shards``
    ranks of one replica (under cp: shard x cp) and replicated across: each micro-batch's padded
    shards all-gathered twice and reduce-scattered once inside the replica, as ``fsdp_tp_bytes``
    without tp, and the reduced padded shard all-reduced over the replicate dimension (FSDP2's HSDP
    reduction; an all-reduce counts twice its bytes)."""
    padded = fsdp_tp_state(named_shapes, shards, 1, 0)["param_bytes"]  # the same on every rank
    return {
        "all_gather_single": accum * 2.0 * shards * padded,
        "reduce_scatter_single": accum * 1.0 * shards * padded,
        "all_reduce": accum * 2.0 * padded,
    }


def add_bytes(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two byte counts by collective, summed."""
    return {op: a.get(op, 0.0) + b.get(op, 0.0) for op in {**a, **b}}


def hybrid_checks(meta, row: dict, shards: int, rank: int, label: str) -> dict[str, float]:
    """HSDP x CP in a run (fully_shard over the replica's ``shards`` = shard x cp ranks, replicated
    across; the vit or the gpt): the rank's measured model state (metrics.json's ``row``) equals the
    shapes' padded shards to the byte; returns HSDP's bytes (``hsdp_bytes``, grad_accum 1)."""
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    state = fsdp_tp_state(shapes, shards, 1, rank % shards)  # row-major, cp innermost: rank % shards its place
    assert {key: row[key] for key in state} == state, (label, state, row)
    return hsdp_bytes(shapes, shards)
