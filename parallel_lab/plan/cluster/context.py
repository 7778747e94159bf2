"""Context parallelism (``strategy.cp``) at cluster scale: every sample's tokens split over cp
ranks, which read the same samples and average their gradients with the data-parallel ranks
(torchtitan's FSDP shards over shard x cp). The mesh lays cp outside pp and tp
(strategies/mesh.py ``DIM_ORDER``): a cp group's ranks are tp x pp apart.

- Compute (``rank_ops``): every GEMM and elementwise operator of the block runs on the rank's
  tokens/cp; the attention core on its queries against every key. Under the load-balanced causal
  ring (the zig-zag layout of strategies/cp/causal.py: rank r holds chunks r and 2cp-1-r of 2cp)
  a fused kernel skips the masked tiles, so each rank runs 1/cp of the causal work, 1/cp of that
  in its own block's causal call and the rest in the other hops' unmasked ones; the model's
  explicit products run 3 of the 4 chunk pairs of its own block and half of every other block's,
  (2cp + 1)/(4cp^2) of the full square. Ulysses (arXiv 2309.14509) gives each rank heads/cp heads
  of whole sequences: 1/cp either way.
- Communication, per block and micro-batch (strategies/cp/rules.py ``context_comm``'s bytes, in the
  run's precision): the ring (Liu et al., arXiv 2310.01889) sends cp - 1 K/V blocks forward, and
  in backward cp - 1 K/V blocks and cp - 1 dK/dV accumulators; each hop is in flight while the rank
  attends to the block it holds, so only what a hop takes beyond 1/cp of the attention core is
  exposed. A fully recomputed forward sends its K/V again. Ulysses: four all-to-alls forward (q,
  k, v to heads, the output back) and their four inverses backward, issued in line: exposed.
- Memory: activations per layer are those of tokens/cp (Korthikanti et al.'s terms at s/cp); the
  ring keeps no scores (it saves q, k, v, its output and the rows' log-sum-exp and recomputes each
  block's scores in backward, as a fused kernel does: with the model's explicit products priced as
  selective recomputation of the attention core), Ulysses its heads/cp heads' scores; the ring's
  receive buffers are a buffer.
"""

from __future__ import annotations

import dataclasses
import functools

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import comm
from parallel_lab.plan.cluster.census import OpRecord, block_ops
from parallel_lab.plan.cluster.compute import DTYPE_BYTES, op_seconds
from parallel_lab.plan.cluster.hardware import Hardware
from parallel_lab.plan.cluster.shape import ModelShape

# DeepSpeed's DistributedAttention is Ulysses: priced as it (as strategies/cp/rules.py counts it)
ULYSSES = ("ulysses", "deepspeed")
IMPLS = ("ring", *ULYSSES)
# The recommender ranks cp (the ring) from this many tokens a sequence: below it a rank's tokens
# fit its memory and the model's GEMMs stay large without it (Llama 3 added CP16 at 131,072 only).
LONG_SEQ = 32_768
RECOMMENDED = (2, 4, 8, 16, 32)


def degrees(shape: ModelShape, gpus: int) -> list[int]:
    """The cp degrees the recommender tries: 1, and at a long sequence each that divides the GPUs
    and splits the sequence into the ring's 2cp chunks."""
    if shape.seq < LONG_SEQ:
        return [1]
    return [1] + [c for c in RECOMMENDED if gpus % c == 0 and shape.seq % (2 * c) == 0]


def check(shape: ModelShape, cp: int, impl: str, tp: int) -> None:
    """One line for a cp layout the model cannot be split into (strategies/cp/rules.py's rules)."""
    if cp <= 1:
        return
    if impl not in IMPLS:
        raise ConfigError(f"strategy.cp_impl={impl} is not priced at cluster scale; use one of: {', '.join(IMPLS)}")
    parts = 2 * cp if impl == "ring" else cp
    if shape.seq % parts:
        why = f"2 x strategy.cp={cp} chunks (the load-balanced causal ring)" if impl == "ring" else f"strategy.cp={cp}"
        raise ConfigError(
            f"model.seq={shape.seq} does not split into {why}; use a model.seq that is a multiple of {parts}"
        )
    if impl in ULYSSES:
        for key, heads in (("heads", shape.heads), ("kv_heads", shape.kv_heads)):
            if (heads // tp) % cp or heads < tp:
                raise ConfigError(
                    f"strategy.cp_impl={impl} gives each of the strategy.cp={cp} ranks whole heads of the "
                    f"{max(1, heads // tp)} {key} of a tp rank (model.{key}={heads}, tp {tp}); use a strategy.cp "
                    f"that divides {max(1, heads // tp)} or strategy.cp_impl=ring"
                )


def core_share(cp: int, impl: str, fused: bool) -> float:
    """A cp rank's share of the census's attention-core work (its FLOPs and score bytes)."""
    if impl == "ring" and not fused:
        return (2 * cp + 1) / (4 * cp * cp)
    return 1.0 / cp


def _on_rank(op: OpRecord, cp: int, impl: str, tokens: int, seq: int, fused: bool) -> OpRecord:
    if op.kind == "gemm":
        dims = [op.m, op.k, op.n]
        if tokens in dims:  # the tokens dimension (the first one of that size: a weight's may equal it)
            dims[dims.index(tokens)] //= cp
        return dataclasses.replace(op, m=dims[0], k=dims[1], n=dims[2], flops=op.flops / cp, bytes=op.bytes / cp)
    if not op.attention_core:
        return dataclasses.replace(op, bytes=op.bytes / cp)  # token-wise: the rank's tokens/cp
    share = core_share(cp, impl, fused)
    if impl in ULYSSES:  # heads/cp heads of whole sequences
        return dataclasses.replace(op, batch=max(1, op.batch // cp), flops=op.flops * share, bytes=op.bytes * share)
    dims = [d // cp if d == seq else d for d in (op.m, op.k, op.n)]  # one hop: a block of queries x keys
    # A fused kernel's causal call is the rank's own block (2 of its 2cp chunk pairs' work); every
    # other hop attends to half a block unmasked: 1/cp of the rank's work runs causal.
    causal = op.causal_share / cp if fused else op.causal_share
    return dataclasses.replace(
        op, m=dims[0], k=dims[1], n=dims[2], flops=op.flops * share, bytes=op.bytes * share, causal_share=causal
    )


def rank_ops(ops: tuple[OpRecord, ...], shape: ModelShape, micro: int, cp: int, impl: str) -> tuple[OpRecord, ...]:
    """The census's block (``micro`` whole sequences) as one of ``cp`` ranks runs it."""
    if cp <= 1:
        return ops
    tokens = micro * shape.seq
    return tuple(_on_rank(op, cp, impl, tokens, shape.seq, shape.fused_attention) for op in ops)


@functools.lru_cache(maxsize=1024)
def block_ops_on_rank(shape: ModelShape, micro: int, cp: int, impl: str) -> tuple[OpRecord, ...]:
    """``rank_ops`` of the census's block (memoised: the recommender asks for each many times)."""
    return rank_ops(block_ops(shape, micro), shape, micro, cp, impl)


@functools.lru_cache(maxsize=4096)
def exposed_block_s(
    hw: Hardware, shape: ModelShape, micro: int, dims, impl: str, dtype: str, recompute: str, sp: bool
) -> float:
    """Exposed context-parallel seconds of one block and micro-batch on one rank (memoised)."""
    if dims.cp <= 1:
        return 0.0
    tokens = micro * shape.seq // dims.cp
    core = core_seconds(block_ops_on_rank(shape, micro, dims.cp, impl), hw, dtype, dims.tp, tokens, sp)
    return exposed_s(hw, shape, micro, dims, impl, DTYPE_BYTES[dtype], recompute, core)


def block_recompute(recompute: str, cp: int, impl: str, fused: bool) -> str:
    """The model's explicit ring recomputes each block's scores in backward: its attention core
    repeated, as selective recomputation does (nothing more where the run already recomputes; a
    fused kernel's backward recomputes them anyway, inside the FLOPs it is priced at)."""
    explicit_ring = cp > 1 and impl == "ring" and not fused
    return "selective" if explicit_ring and recompute == "none" else recompute


def kv_block_bytes(shape: ModelShape, micro: int, cp: int, tp: int, width: int) -> float:
    """One rank's keys (or values): micro x seq/cp tokens x its kv heads (kv_heads/tp, at least one)."""
    kv_heads = max(1, shape.kv_heads // tp)
    return micro * shape.seq / cp * kv_heads * shape.head_dim * width


def ring_bytes(shape: ModelShape, micro: int, cp: int, tp: int, width: int, recompute: str) -> dict[str, float]:
    """Bytes one rank sends per block and micro-batch around the ring: forward (cp - 1) K/V blocks
    (again in a fully recomputed forward), backward (cp - 1) K/V blocks and (cp - 1) dK/dV."""
    kv = 2 * kv_block_bytes(shape, micro, cp, tp, width)
    forward = (cp - 1) * kv
    return {"forward": forward * (2 if recompute == "full" else 1), "backward": 2 * (cp - 1) * kv}


def ulysses_bytes(shape: ModelShape, micro: int, cp: int, tp: int, width: int, recompute: str) -> float:
    """Bytes one rank hands to its all-to-alls per block and micro-batch: q, k, v and the output
    forward (2Q + 2K), their gradients backward, the forward's again under full recomputation."""
    q = micro * shape.seq / cp * (shape.hidden // tp) * width
    k = kv_block_bytes(shape, micro, cp, tp, width)
    return (2 * q + 2 * k) * (3 if recompute == "full" else 2)


def all_to_all_s(hw: Hardware, buffer_bytes: float, size: int, stride: int) -> float:
    """An all-to-all of ``buffer_bytes`` per rank: (n-1)/n of it leaves over the rank's link, one latency."""
    if size <= 1 or buffer_bytes <= 0:
        return 0.0
    bandwidth, latency = comm.link(hw, size, stride)
    return latency + (size - 1) / size * buffer_bytes / bandwidth


def hop_s(hw: Hardware, payload: float, cp: int, stride: int) -> float:
    """One ring hop: the ring's slowest link (across nodes where the cp group leaves one)."""
    bandwidth, latency = comm.link(hw, cp, stride)
    return latency + payload / bandwidth


def core_seconds(ops: tuple[OpRecord, ...], hw: Hardware, dtype: str, tp: int, tokens: int, sp: bool) -> tuple:
    """(forward, backward) seconds of one rank's attention core (the ring's recomputed scores in backward)."""
    fwd = sum(op_seconds(o.on_tp_rank(tp, tokens, sp), hw, dtype) for o in ops if o.attention_core and o.phase == "fwd")
    bwd = sum(op_seconds(o.on_tp_rank(tp, tokens, sp), hw, dtype) for o in ops if o.attention_core and o.phase == "bwd")
    return fwd, bwd


def exposed_s(
    hw: Hardware, shape: ModelShape, micro: int, dims, impl: str, width: int, recompute: str, core: tuple
) -> float:
    """Exposed context-parallel seconds per block and micro-batch on one rank (``core``: its
    attention core's (forward, backward) seconds, ``core_seconds``)."""
    cp, tp, stride = dims.cp, dims.tp, dims.tp * dims.pp
    if cp <= 1:
        return 0.0
    if impl in ULYSSES:
        calls = 12 if recompute == "full" else 8
        per_call = ulysses_bytes(shape, micro, cp, tp, width, recompute) / calls
        return calls * all_to_all_s(hw, per_call, cp, stride)
    sent = ring_bytes(shape, micro, cp, tp, width, recompute)
    fwd_core, bwd_core = core
    passes = 2 if recompute == "full" else 1
    fwd_hop = hop_s(hw, sent["forward"] / (passes * (cp - 1)), cp, stride)
    bwd_hop = hop_s(hw, sent["backward"] / (cp - 1), cp, stride)
    return (cp - 1) * (passes * max(0.0, fwd_hop - fwd_core / cp) + max(0.0, bwd_hop - bwd_core / cp))


def ring_buffer_bytes(shape: ModelShape, micro: int, cp: int, tp: int, width: int, impl: str) -> float:
    """The ring's receive buffers at backward's peak: the K/V block held and the one arriving, the
    dK/dV accumulator sent and the one arriving (strategies/cp/ring.py ``ring_backward``)."""
    if cp <= 1 or impl != "ring":
        return 0.0
    return 4 * 2 * kv_block_bytes(shape, micro, cp, tp, width)
