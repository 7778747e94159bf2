"""Each operator's time on one GPU from its shape: a GEMM runs at a share of the dtype's peak that
falls with each of its dimensions (d / (d + gemm_half_dim): thin GEMMs leave the tensor cores
idle, tile and wave quantisation), and never faster than HBM can feed it (roofline); a fused
attention kernel runs at the rate its own benchmarks report (``attention_seconds``); every other
operator moves its bytes at ``memory_efficiency`` of the HBM bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.plan.cluster.census import OpRecord
from parallel_lab.plan.cluster.hardware import Hardware

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# FlashAttention's backward recomputes the scores (S = QK^T) from q and k: five products where the
# census's explicit backward counts four (two per forward product). Its benchmarks count the
# backward as 2.5x the forward's FLOPs (Dao, arXiv 2307.08691 section 4.1), i.e. 5/4 of ours.
KERNEL_BACKWARD_FLOPS = 5 / 4


def gemm_share(hw: Hardware, m: int, k: int, n: int) -> float:
    """The share of peak a (m x k) @ (k x n) GEMM reaches: the fitted ceiling times each dimension's factor."""
    half = hw.gemm_half_dim
    return hw.gemm_efficiency * (m / (m + half)) * (k / (k + half)) * (n / (n + half))


def op_seconds(op: OpRecord, hw: Hardware, dtype: str) -> float:
    """One operator's seconds: GEMMs by their shape (bounded by their operands' traffic), the rest by bytes."""
    bandwidth = hw.hbm_gb_per_s * 1e9 * hw.memory_efficiency
    if op.kind == "memory":
        return op.bytes / bandwidth
    if op.kind == "attention":
        return attention_seconds(op, hw, dtype)
    width = DTYPE_BYTES[dtype]
    traffic = op.batch * width * (op.m * op.k + op.k * op.n + op.m * op.n)
    compute = op.flops / (hw.peak_flops(dtype) * gemm_share(hw, op.m, op.k, op.n))
    return max(compute, traffic / bandwidth)


def attention_seconds(op: OpRecord, hw: Hardware, dtype: str) -> float:
    """A fused attention kernel (FlashAttention) priced as its papers measure it, not at the GEMM
    ceiling: the profile's ``attention_efficiency`` is the kernel's TFLOP/s over the dense peak per
    phase, unmasked and causal (FlashAttention-2, arXiv 2307.08691; FlashAttention-3, arXiv
    2407.08608, Figures 5-6: head dim 128, 8k tokens), in the papers' FLOP count: a causal call
    counts the unmasked half (as the census does), a backward 5/4 of the census's. The share of the
    op's FLOPs in causal calls (``causal_share``: 1 for one causal kernel, 1/cp on a zig-zag ring
    rank, whose other hops run unmasked) runs at the causal rate, the rest at the unmasked one;
    nothing goes through HBM (the scores stay on chip)."""
    shares = hw.attention_efficiency
    flops = op.flops * (KERNEL_BACKWARD_FLOPS if op.phase == "bwd" else 1.0)
    per_flop = op.causal_share / shares[f"{op.phase}_causal"] + (1.0 - op.causal_share) / shares[op.phase]
    return flops * per_flop / hw.peak_flops(dtype)


@dataclass(frozen=True)
class PassTime:
    """One micro-batch through one block on one rank: forward, backward and the recomputed forward."""

    forward_s: float
    backward_s: float
    recompute_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s


def block_pass(
    ops: tuple[OpRecord, ...], hw: Hardware, dtype: str, tp: int, tokens: int, sequence_parallel: bool, recompute: str
) -> PassTime:
    """A block's forward, backward and recomputation seconds on one of ``tp`` ranks. Full
    recomputation repeats the forward in backward; selective only the attention core (scores,
    softmax, weighted sum: Korthikanti et al., arXiv 2205.05198, section 5); torchtitan's
    per-operator policy (``selective_op``) every second matrix multiply and every elementwise
    operator, keeping the other products and the fused attention kernel's output."""
    fwd = bwd = again = 0.0
    gemms = 0
    for op in ops:
        seconds = op_seconds(op.on_tp_rank(tp, tokens, sequence_parallel), hw, dtype)
        if op.phase == "bwd":
            bwd += seconds
            continue
        fwd += seconds
        gemms += op.kind == "gemm"
        if recomputed(op, recompute, gemms):
            again += seconds
    return PassTime(fwd, bwd, again)


def recomputed(op: OpRecord, recompute: str, gemms_so_far: int) -> bool:
    """Whether ``recompute`` repeats this forward operator in backward (``gemms_so_far``: the
    forward's matrix multiplies up to and including this one)."""
    if recompute == "selective_op":
        return op.kind in ("memory", "bmm") or (op.kind == "gemm" and gemms_so_far % 2 == 0)
    return recompute == "full" or (recompute == "selective" and op.attention_core)


def logits_pass(tokens: int, hidden: int, vocab: int, tp: int, hw: Hardware, dtype: str) -> float:
    """The output layer (vocab-parallel over tp, Megatron) and its cross-entropy: one GEMM forward,
    two backward, and the fp32 logits read and written about four times."""
    gemm = OpRecord("gemm", "fwd", 2.0 * tokens * hidden * vocab / tp, m=tokens, k=hidden, n=max(1, vocab // tp))
    loss = OpRecord("memory", "fwd", bytes=4.0 * 4 * tokens * vocab / tp)
    return 3 * op_seconds(gemm, hw, dtype) + op_seconds(loss, hw, dtype)
