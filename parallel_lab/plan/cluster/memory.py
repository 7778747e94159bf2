"""Per-GPU memory of a cluster layout: model state as ZeRO counts it (arXiv 1910.02054: 2 bytes of
16-bit weights, 2 of gradients, 12 of fp32 master weights and Adam's two moments per parameter;
fp32 training 4 + 4 + 8), sharded by the layout's stage; activations per layer from Korthikanti et
al. (arXiv 2205.05198, Table 2) times the micro-batches the pipeline schedule keeps in flight, or,
under torchtitan's per-operator checkpointing (``selective_op``), what its policy keeps of the real
block's operators; and the buffers (gathered parameters of ZeRO-3/FSDP, the profile's fixed
overhead). The sum is what the allocator holds at the peak; the caching allocator reserves
``allocator_slack`` more (its segments are not all full), the figure torch reports as reserved."""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.plan.cluster.shape import ModelShape


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the model state, before sharding."""

    weights: int
    grads: int
    optimizer: int


def state_bytes(precision: str, optimizer: str) -> StateBytes:
    """Mixed precision keeps fp32 master weights beside Adam's moments (K = 12); fp32 none (K = 8);
    SGD with momentum keeps one moment."""
    moments = 8 if optimizer in ("adam", "adamw") else 4
    if precision == "fp32":
        return StateBytes(4, 4, moments)
    return StateBytes(2, 2, moments + 4)


def params_on_rank(shape: ModelShape, tp: int, pp: int, first: bool) -> int:
    """Parameters the first (or the last) pipeline stage of one tp rank holds: its blocks, and the
    embedding (first) or the output layer (last: a tied one keeps its own copy, as Megatron does)."""
    blocks = shape.layers // pp * shape.layer_params()
    ends = shape.vocab * shape.hidden
    if pp == 1:
        ends = shape.embedding_params()
    return (blocks + ends) // tp


def model_state(params: int, kind: StateBytes, stage: int, ways: int) -> dict[str, int]:
    """Weights, gradients and optimizer state of ``params`` parameters, the parts ZeRO's ``stage``
    shards divided over ``ways`` data-parallel ranks."""

    def part(per_param: int, sharded: bool) -> int:
        return params * per_param // (ways if sharded else 1)

    return {
        "weights": part(kind.weights, stage >= 3),
        "grads": part(kind.grads, stage >= 2),
        "optimizer": part(kind.optimizer, stage >= 1),
    }


def layer_activation_bytes(
    shape: ModelShape,
    micro: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    flash: bool,
    cp: int = 1,
    cp_impl: str = "ring",
) -> float:
    """Bytes one block keeps for backward per micro-batch (Korthikanti et al. Table 2, 16-bit
    activations, 1-byte dropout masks): sbh(10 + 24/t + 5as/(ht)) under tp, 34/t for the first term
    with sequence parallelism, the attention term gone under selective recomputation (and under a
    fused attention kernel, which keeps no scores), 2sbh (/t with sp) under full recomputation.
    Under context parallelism a rank holds s/cp tokens: the token terms at s/cp; the scores of
    Ulysses' heads/cp heads over whole sequences are 1/cp of them, the ring keeps none (context.py)."""
    s, b, h, a, t = shape.seq, micro, shape.hidden, shape.heads, tp
    sbh = s * b * h / cp
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    no_scores = recompute == "selective" or flash or (cp > 1 and cp_impl == "ring")
    scores = 0.0 if no_scores else 5 * a * s / (h * t)
    return sbh * (linear + scores)


def op_policy_bytes(ops, tp: int, tokens: int, hidden: int, sequence_parallel: bool, width: int) -> float:
    """Bytes one block keeps per micro-batch under torchtitan's per-operator selective
    checkpointing (``selective_ac_option = 'op'``, its Llama 3 8B default): the block's input, the
    output of every other matrix multiply (the first, third, ...: the policy recomputes every second
    one) and of a fused attention kernel (with its fp32 log-sum-exp); every other operator is
    recomputed. ``ops`` are the census's records of the real block (census.block_ops)."""
    kept = tokens * hidden * width / (tp if sequence_parallel else 1)
    gemms = 0
    for op in (o.on_tp_rank(tp, tokens, sequence_parallel) for o in ops if o.phase == "fwd"):
        if op.kind == "gemm":
            gemms += 1
            kept += op.m * op.n * width if gemms % 2 else 0
        elif op.kind == "attention":
            kept += tokens * hidden * width / tp + op.batch * op.m * 4
    return kept


def in_flight(schedule: str | None, pp: int, microbatches: int, virtual: int) -> float:
    """Micro-batches of its own layers the first stage holds at once: GPipe all m, 1F1B p, the
    interleaved schedule p(1 + (p-1)/(pv)) (arXiv 2104.04473 section 2.2; 2205.05198 section 4.2)."""
    if schedule is None or pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    extra = (pp - 1) / (pp * virtual) if virtual > 1 else 0.0
    return min(microbatches, pp) * (1 + extra)


def logits_bytes(shape: ModelShape, micro: int, tp: int, cp: int = 1) -> float:
    """The last stage's fp32 logits at the loss's backward (vocab-parallel over tp): cross-entropy as
    log-softmax then NLL keeps the log-softmax's fp32 output, and its backward holds that, the
    gradient NLL writes and the gradient it writes at once (three copies); a cp rank its s/cp tokens'."""
    return 3 * 4.0 * shape.seq * micro * shape.vocab / (tp * cp)
