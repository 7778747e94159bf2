"""Ring attention (Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", arXiv 2310.01889): each cp rank holds a block of the tokens' queries, keys
and values; the K/V blocks go around the ring of cp ranks (send to the next, receive from the
previous, overlapped with the block's computation), and each rank merges the attention of its
queries over every K/V block with an online softmax, so no rank ever holds all the keys.

Forward, per block j: scores s_j = q k_j^T * scale, the block's log-sum-exp l_j = logsumexp(s_j)
and output o_j = exp(s_j - l_j) v_j; blocks merge by l = logaddexp(l_a, l_b), o = o_a exp(l_a - l)
+ o_b exp(l_b - l): the softmax over all keys, exact, block by block. cp - 1 hops of K/V.

Backward (its own, a custom autograd Function): the forward keeps q, k, v, the output o and the
row log-sum-exp l (not the tokens x tokens probabilities). With D = rowsum(dO * o), each block's
probabilities are recomputed as p_j = exp(s_j - l), then dv_j = p_j^T dO, ds_j = p_j * (dO v_j^T - D),
dq += ds_j k_j * scale, dk_j = ds_j^T q * scale. The K/V blocks go around the ring again (cp - 1
hops), and each block's dK/dV accumulator travels with it from the rank after its owner, collecting
every rank's share, and arrives home on the last hop (cp - 1 hops); the owner adds its own share.
So a step's bytes per rank per attention: forward (cp - 1) x (K, V); backward (cp - 1) x (K, V) and
(cp - 1) x (dK, dV).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallel_lab.strategies.cp.comm import CPGroup, RingPass

KV_TAG, DKV_TAG = 11, 12  # the two kinds of hops in flight at once in backward


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, future: torch.Tensor | None) -> torch.Tensor:
    """q k^T * scale, the keys in ``future`` (a (queries, keys) bool mask, None: none) at -inf."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return scores if future is None else scores.masked_fill(future, float("-inf"))


def _block(q, k, v, scale: float, future: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One K/V block's attention output and its rows' log-sum-exp (every row sees a key)."""
    scores = _scores(q, k, scale, future)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def _merge(out, lse, block_out: torch.Tensor, block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two partial attentions over disjoint keys -> the attention over both."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged), merged


def _block_grads(q, k, v, dout, lse, delta, scale: float, future: torch.Tensor | None = None):
    """(dq, dk, dv) of one K/V block, its probabilities recomputed from the saved log-sum-exp."""
    probs = torch.exp(_scores(q, k, scale, future) - lse)
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta)
    return torch.matmul(dscores, k) * scale, torch.matmul(dscores.transpose(-2, -1), q) * scale, dv


class RingAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v over every cp rank's keys, for this rank's queries: (batch, heads,
    tokens/cp, head_dim) in and out."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cp: CPGroup) -> torch.Tensor:
        def block(step: int, kv: torch.Tensor, out, lse):
            return _merge(out, lse, *_block(q, kv[0], kv[1], scale))

        out, lse = ring_forward(torch.stack([k, v]), cp, block)
        ctx.scale, ctx.cp = scale, cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        scale, cp = ctx.scale, ctx.cp
        delta = (dout * out).sum(dim=-1, keepdim=True)

        def block(step: int, kv: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
            dq_j, dk_j, dv_j = _block_grads(q, kv[0], kv[1], dout, lse, delta, scale)
            dq += dq_j
            return torch.stack([dk_j, dv_j])

        return (*ring_backward(q, torch.stack([k, v]), cp, block), None, None)


def ring_forward(kv: torch.Tensor, cp: CPGroup, block: Callable):
    """The ring's forward pass, shared by the plain and the causal ring: K/V (stacked, one message
    per hop) go round the cp ranks, the next block in flight while this one is attended to;
    ``block(step, kv, out, lse)`` merges the block held at ``step`` into the online softmax's
    (out, lse) and returns them. Returns the final (out, lse)."""
    out = lse = None
    for step in range(cp.size):
        hop = RingPass(kv, cp, KV_TAG) if step + 1 < cp.size else None
        out, lse = block(step, kv, out, lse)
        if hop is not None:
            kv = hop.wait()
    return out, lse


BlockGrads = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def ring_backward(q: torch.Tensor, kv: torch.Tensor, cp: CPGroup, block: BlockGrads):
    """The ring's backward pass, shared by the plain and the causal ring: K/V go round again, and
    each block's K/V gradient travels with it, accumulated by every rank it passes, until it comes
    home to the rank that owns it. ``block(step, kv, dq)`` adds this rank's queries' gradient from
    the block held at ``step`` into dq and returns the block's (dk, dv) share, stacked.
    Returns (dq, dk, dv) of this rank's own block."""
    dq, own, carried = torch.zeros_like(q), None, None
    for step in range(cp.size):
        hop = RingPass(kv, cp, KV_TAG) if step + 1 < cp.size else None
        dkv = block(step, kv, dq)
        if step == 0:
            own = dkv  # this rank's share of its own block: stays home
        else:  # this block's accumulator, from the rank before (it started one rank after the owner)
            if carried is not None:
                dkv += carried.wait()
            carried = RingPass(dkv, cp, DKV_TAG)
        if hop is not None:
            kv = hop.wait()
    if carried is not None:  # the last hop brought every other rank's share of this rank's block
        own = own + carried.wait()
    return dq, own[0], own[1]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cp: CPGroup) -> torch.Tensor:
    """Attention of this rank's queries over every cp rank's keys and values (``RingAttention``)."""
    return RingAttention.apply(q, k, v, scale, cp)
