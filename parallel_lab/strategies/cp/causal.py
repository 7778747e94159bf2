"""Causal ring attention, load-balanced: the gpt's attention over the cp ranks (ring.py's online
softmax and own backward, with the causal mask and grouped-query attention).

Balance (the zig-zag split of Megatron-Core's context parallelism and torchtitan's "load-balanced"
ring, after Brandon et al., "Striped Attention", arXiv 2311.09431, and Liu et al., arXiv
2310.01889): the sequence is cut into 2cp chunks of c = seq/(2cp) tokens, and cp rank r holds chunks
r and 2cp-1-r, in that order. Under a causal mask a rank holding only the sequence's end would do
cp times the work of the rank holding its start; with one chunk from each end every rank does the
same. K/V blocks go around the ring as in ring.py, and the block that came from rank s is, for the
queries of rank r:

- s = r (the first step, the rank's own): causal within the rank's 2c tokens, which are in
  sequence order (chunk r before chunk 2cp-1-r): the plain causal mask;
- s < r: chunk s lies before both of r's chunks, chunk 2cp-1-s after both: every query sees the
  block's first half and none of its second (2c x c scores);
- s > r: both of s's chunks lie after chunk r and before chunk 2cp-1-r: the queries of the second
  half see the whole block, those of the first half none of it (c x 2c scores).

So no score is computed that the mask would discard, and every rank computes (2c)^2/2 + (cp-1) 2c^2
scores. Grouped-query attention: the K/V blocks travel with their kv_heads heads (heads/kv_heads
times fewer bytes than the queries' width), each kv head widened to its query heads for the block's
product only; its gradient is summed back over them before it travels.
"""

from __future__ import annotations

import torch

from parallel_lab.strategies.cp.comm import SEQ, CPGroup
from parallel_lab.strategies.cp.ring import _block, _block_grads, _merge, ring_backward, ring_forward


def _widen(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads, t, d) -> (batch, heads, t, d): each kv head serves ``groups`` query heads."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse's gradient: each kv head's ``groups`` query heads' gradients summed."""
    return t.unflatten(1, (-1, groups)).sum(2) if groups > 1 else t


def _future(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _earlier(cp: CPGroup, step: int) -> bool:
    """Whether the block held at ``step`` (rank (r - step) mod cp's) came from an earlier rank."""
    return (cp.rank - step) % cp.size < cp.rank


def _attend(q, kv: torch.Tensor, scale: float, cp: CPGroup, step: int, out, lse):
    """The module docstring's three cases: merge the block of ``step`` into (out, lse)."""
    groups, c = q.shape[1] // kv.shape[2], q.shape[SEQ] // 2
    k, v = _widen(kv[0], groups), _widen(kv[1], groups)
    if step == 0:
        return _block(q, k, v, scale, _future(2 * c, q.device))
    if _earlier(cp, step):  # every query sees the block's first chunk
        return _merge(out, lse, *_block(q, k[:, :, :c], v[:, :, :c], scale))
    late = _merge(out[:, :, c:], lse[:, :, c:], *_block(q[:, :, c:], k, v, scale))  # the second chunk's queries
    return tuple(torch.cat([whole[:, :, :c], part], dim=SEQ) for whole, part in zip((out, lse), late))


def _gradients(q, kv: torch.Tensor, dout, lse, delta, scale: float, cp: CPGroup, step: int, dq: torch.Tensor):
    """Adds the block of ``step``'s share of dq into ``dq``; returns its (dK, dV), kv_heads wide."""
    groups, c = q.shape[1] // kv.shape[2], q.shape[SEQ] // 2
    k, v = _widen(kv[0], groups), _widen(kv[1], groups)
    if step == 0:
        dq_j, dk, dv = _block_grads(q, k, v, dout, lse, delta, scale, _future(2 * c, q.device))
        dq += dq_j
    elif _earlier(cp, step):  # the block's second chunk had no query: its gradient is zero
        dq_j, dk, dv = _block_grads(q, k[:, :, :c], v[:, :, :c], dout, lse, delta, scale)
        dq += dq_j
        dk, dv = (torch.cat([g, torch.zeros_like(g)], dim=SEQ) for g in (dk, dv))
    else:  # only the second chunk's queries saw it
        sq, sdout, slse, sdelta = (t[:, :, c:] for t in (q, dout, lse, delta))
        dq_j, dk, dv = _block_grads(sq, k, v, sdout, slse, sdelta, scale)
        dq[:, :, c:] += dq_j
    return torch.stack([_fold(dk, groups), _fold(dv, groups)])


class CausalRingAttention(torch.autograd.Function):
    """Causal softmax(q k^T * scale) v over every cp rank's keys for this rank's queries, the tokens
    held as the module docstring's two chunks: q (batch, heads, 2c, d), k and v (batch, kv_heads,
    2c, d)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cp: CPGroup) -> torch.Tensor:
        def block(step: int, kv: torch.Tensor, out, lse):
            return _attend(q, kv, scale, cp, step, out, lse)

        out, lse = ring_forward(torch.stack([k, v]), cp, block)  # K/V kv_heads wide
        ctx.scale, ctx.cp = scale, cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        scale, cp = ctx.scale, ctx.cp
        delta = (dout * out).sum(dim=-1, keepdim=True)

        def block(step: int, kv: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
            return _gradients(q, kv, dout, lse, delta, scale, cp, step, dq)

        return (*ring_backward(q, torch.stack([k, v]), cp, block), None, None)


def causal_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cp: CPGroup) -> torch.Tensor:
    """Causal attention of this rank's two chunks of queries over every cp rank's keys and values."""
    return CausalRingAttention.apply(q, k, v, scale, cp)
