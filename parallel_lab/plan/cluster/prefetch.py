"""DeepSpeed ZeRO-3's parameter traffic at the granularity it runs at: one sub-module at a time.

DeepSpeed's stage 3 (the engine Narayanan et al. 2021, arXiv 2104.04473, ran for Table 2; its
parameter coordinator of 2021 and today's alike) gathers a module's parameters in that module's
pre-forward (or pre-backward) hook and waits for them there (the 2021 code with a device-wide
synchronize), then starts the gather of the next module that needs one (the prefetch: at least one
parameter, up to ``stage3_prefetch_bucket_size`` elements, so one weight ahead wherever a weight is
larger than the bucket). The time from one such wait to the next is therefore the longer of the
compute between them and the next gather (in backward also the reduce-scatter of the gradients the
previous stretch produced: the same link). Summed per stretch, that is more than the longer of the
pass's compute and its traffic wherever the two are out of step from module to module: the
attention core computes with no weight to gather, the thin output projection hides little of the
MLP's first weight. A module used again within ``stage3_max_reuse_distance`` elements (1e9 by
default) keeps its parameters: under full recomputation, the last modules of the recomputed forward
are not gathered again for their backward.

The linear weights of the block's census (``census.py``) are the modules; whatever else the model
holds (embeddings, norms, biases) is gathered and reduced beside them without overlap. The rings'
latency is counted once per pass and collective kind, as the other strategies' traffic is.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.plan.cluster import comm
from parallel_lab.plan.cluster.compute import DTYPE_BYTES, op_seconds, recomputed

MAX_REUSE_DISTANCE = 1e9  # DeepSpeed's stage3_max_reuse_distance default (elements)


@dataclass(frozen=True)
class Visit:
    """One module's turn in a pass: its compute seconds, whether it must gather first, and the
    weight elements it gathers and (in backward) reduce-scatters afterwards."""

    compute_s: float
    weight: int
    gathers: bool
    reduces: bool = False


def _groups(ops, hw, run, tokens: int, phase: str, per: int) -> list[list]:
    """The block's operators of ``phase`` cut at every ``per``-th GEMM (forward: each linear; backward:
    each linear's two products): [seconds, recompute seconds, the GEMM that opens the group]. What
    precedes the first GEMM (the pre-norm) closes the previous block's last group."""
    out, lead, count, gemms = [], [0.0, 0.0], 0, 0
    for op in ops:
        if op.phase != phase:
            continue
        rank_op = op.on_tp_rank(run.layout.dims.tp, tokens, run.layout.sequence_parallel)
        if op.kind == "gemm":
            gemms += phase == "fwd"
            if count % per == 0:
                out.append([0.0, 0.0, rank_op])
            count += 1
        seconds = op_seconds(rank_op, hw, run.precision)
        again = seconds if phase == "fwd" and recomputed(op, run.recompute, gemms) else 0.0
        target = out[-1] if out else lead
        target[0] += seconds
        target[1] += again
    if out:
        out[-1][0] += lead[0]
        out[-1][1] += lead[1]
    return out


def _visits(ops, hw, run, tokens: int) -> tuple[list[Visit], list[Visit], int]:
    """(the forward's visits, the backward's, the block's weight elements) of one block."""
    fwd, bwd = _groups(ops, hw, run, tokens, "fwd", 1), _groups(ops, hw, run, tokens, "bwd", 2)
    weights = [group[2].k * group[2].n for group in fwd]
    forward = [Visit(group[0], w, True) for group, w in zip(fwd, weights)]
    full = run.recompute == "full"
    backward = list(forward) if full else []  # the recomputed forward gathers what its forward released
    after = [sum(weights[i + 1 :]) for i in range(len(weights))]
    for j, group in enumerate(bwd):
        mine = len(weights) - 1 - j  # backward runs the linears in reverse
        kept = full and 2 * after[mine] < MAX_REUSE_DISTANCE
        again = 0.0 if full else fwd[mine][1]
        backward.append(Visit(group[0] + again, weights[mine], not kept, reduces=True))
    return forward, backward, sum(weights)


def _stretches(visits: list[Visit], gather_s, reduce_s) -> float:
    """Seconds of one block's visits, the next block's first gather prefetched in its last stretch:
    each stretch from one gathering visit to the next lasts the longer of its compute and the
    traffic beside it (the next gather, the previous stretch's reduce-scatters)."""
    first = next((i for i, v in enumerate(visits) if v.gathers), 0)
    visits = visits[first:] + visits[:first]  # what precedes the first gather ends the previous block
    starts = [i for i, v in enumerate(visits) if v.gathers] or [0]
    total, pending = 0.0, sum(reduce_s(v.weight) for v in visits[starts[-1] :] if v.reduces)
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(visits)
        stretch = visits[start:end]
        following = visits[starts[(k + 1) % len(starts)]]
        traffic = gather_s(following.weight) + pending
        total += max(sum(v.compute_s for v in stretch), traffic)
        pending = sum(reduce_s(v.weight) for v in stretch if v.reduces)
    return total


def exposed_s(run, ops, tokens: int, blocks: int, params: int) -> float:
    """Exposed data-parallel seconds of one micro-batch under DeepSpeed's ZeRO-3: the blocks'
    stretches beyond their compute, the rest of the model's traffic, the rings' latency."""
    lay, dims, hw = run.layout, run.layout.dims, run.hw
    ways, stride = max(1, lay.shard_ways), dims.tp * dims.pp
    replicas = run.dp // ways
    bandwidth, latency = comm.link(hw, ways, stride)
    width = DTYPE_BYTES[run.precision]

    def gather_s(elements: int) -> float:
        return (ways - 1) / ways * elements * width / bandwidth

    def reduce_s(elements: int) -> float:
        return gather_s(elements) + comm.all_reduce_s(hw, elements * width / ways, replicas, stride * ways)

    forward, backward, block = _visits(ops, hw, run, tokens)
    compute = sum(v.compute_s for v in forward + backward)
    hidden = blocks * (_stretches(forward, gather_s, reduce_s) + _stretches(backward, gather_s, reduce_s) - compute)
    rest = max(0, params - blocks * block)
    passes = 3 + (run.recompute == "full")
    return hidden + 2 * gather_s(rest) + reduce_s(rest) + passes * (ways - 1) * latency
