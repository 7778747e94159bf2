"""The cluster planner's price of a fused attention kernel (plan/cluster/compute.py
``attention_seconds``): the kernel's FLOPs counted in the test from the attention formula, priced at
the profile's FlashAttention shares (arXiv 2307.08691, 2407.08608), never at the GEMM ceiling; a cp
ring rank's causal and unmasked calls; the profile's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import context
from parallel_lab.plan.cluster.census import block_ops
from parallel_lab.plan.cluster.compute import block_pass, op_seconds
from parallel_lab.plan.cluster.hardware import from_spec
from parallel_lab.plan.cluster.shape import ModelShape

SHAPE = ModelShape(
    layers=2, hidden=512, heads=8, kv_heads=2, ffn=1024, seq=4096, vocab=1000, gated=True, rotary=True,
    fused_attention=True,
)  # fmt: skip


def _kernel_flops(shape: ModelShape, micro: int, tp: int, causal: bool) -> float:
    """FlashAttention's benchmark count for one forward: 4 x batch x seq^2 x heads x head_dim (QK^T
    and PV, 2 FLOPs a multiply-add), halved under the causal mask; a tp rank holds heads/tp heads."""
    return 4 * micro * shape.seq**2 * (shape.heads // tp) * shape.head_dim / (2 if causal else 1)


def _attention_s(ops, hw, tp: int, tokens: int, phase: str) -> float:
    core = [o for o in ops if o.attention_core and o.phase == phase]
    return sum(op_seconds(o.on_tp_rank(tp, tokens, False), hw, "bf16") for o in core)


def test_fused_attention_runs_at_the_kernels_measured_rate():
    """One causal kernel per phase: the forward's FLOPs at ``fwd_causal`` of peak, the backward's
    2.5x the forward's (it recomputes QK^T) at ``bwd_causal``; nothing else of the block changes."""
    hw, micro, tp = from_spec("h100_sxm"), 2, 2
    peak, shares = 989e12, hw.attention_efficiency
    fwd = _kernel_flops(SHAPE, micro, tp, causal=True)
    ops = block_ops(SHAPE, micro)
    tokens = micro * SHAPE.seq
    assert _attention_s(ops, hw, tp, tokens, "fwd") == pytest.approx(fwd / (peak * shares["fwd_causal"]))
    assert _attention_s(ops, hw, tp, tokens, "bwd") == pytest.approx(2.5 * fwd / (peak * shares["bwd_causal"]))
    # the rest of the block is the GEMMs and elementwise operators, priced as before
    rest = tuple(o for o in ops if not o.attention_core)
    whole, other = (block_pass(x, hw, "bf16", tp, tokens, False, "none") for x in (ops, rest))
    assert whole.forward_s - other.forward_s == pytest.approx(fwd / (peak * shares["fwd_causal"]))
    # a kernel's share of peak is not the GEMM ceiling: a faster GEMM leaves attention as it was
    fast_gemm = from_spec("h100_sxm;gemm_efficiency=1.0;gemm_half_dim=1")
    assert _attention_s(ops, fast_gemm, tp, tokens, "fwd") == _attention_s(ops, hw, tp, tokens, "fwd")


def test_unmasked_kernel_and_cp_ranks_split_causal_from_unmasked_calls():
    """A vit-like unmasked kernel runs every FLOP at ``fwd``/``bwd``. A zig-zag ring rank (cp 4)
    runs 1/cp of the causal work: its own block (chunks r and 2cp-1-r, 2 of the 2cp chunk pairs'
    worth) in a causal call, the cp-1 other hops' half blocks unmasked; Ulysses heads/cp heads of
    whole sequences, all causal."""
    hw, cp = from_spec("h100_sxm"), 4
    peak, s = 989e12, hw.attention_efficiency
    plain = dataclasses.replace(SHAPE, name="unmasked", family="vit")  # the vit's block: no causal mask
    vit_ops = block_ops(plain, 1)
    full = _kernel_flops(plain, 1, 1, causal=False)
    assert _attention_s(vit_ops, hw, 1, plain.seq, "fwd") == pytest.approx(full / (peak * s["fwd"]))
    assert _attention_s(vit_ops, hw, 1, plain.seq, "bwd") == pytest.approx(2.5 * full / (peak * s["bwd"]))
    causal = _kernel_flops(SHAPE, 1, 1, causal=True)
    ring = context.block_ops_on_rank(SHAPE, 1, cp, "ring")
    tokens = SHAPE.seq // cp
    for phase, scale in (("fwd", 1.0), ("bwd", 2.5)):
        own, hops = causal / cp / cp, causal / cp * (cp - 1) / cp
        want = scale * (own / s[f"{phase}_causal"] + hops / s[phase]) / peak
        assert _attention_s(ring, hw, 1, tokens, phase) == pytest.approx(want)
    ulysses = context.block_ops_on_rank(SHAPE, 1, cp, "ulysses")
    assert _attention_s(ulysses, hw, 1, tokens, "fwd") == pytest.approx(causal / cp / (peak * s["fwd_causal"]))


def test_attention_shares_are_required_and_positive():
    """Every shipped profile names the four shares, each in (0, 1]; a missing or zero one is one line."""
    for name in ("a100_40g", "a100_80g", "h100_sxm", "h200", "this_machine"):
        shares = from_spec(name).attention_efficiency
        assert set(shares) == {"fwd", "fwd_causal", "bwd", "bwd_causal"} and all(0 < v <= 1 for v in shares.values())
    with pytest.raises(ConfigError, match="attention_efficiency lacks a positive bwd_causal; set plan.hardware"):
        from_spec("h100_sxm;attention_efficiency.bwd_causal=0")
