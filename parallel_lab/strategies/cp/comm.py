"""Context parallelism's communication: the ring's neighbour exchange (ring attention), the
all-to-all that turns a sequence-sharded tensor into a head-sharded one and back (DeepSpeed-Ulysses),
and the pool of the vit's head over the ranks' tokens.

Every function takes a ``CPGroup``: the cp ranks' process group (None: the world), this rank's
place in it and the group's global ranks (send/recv address global ranks). On the meta device (the
planner's forward) nothing is sent: each function only shapes its output, so the planner counts
what autograd saves on the very code the run executes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

TOKENS = 1  # the tokens dimension of the vit's (batch, tokens, dim) activations
HEADS, SEQ = 1, 2  # the attention core's (batch, heads, tokens, head_dim) layout


@dataclass(frozen=True)
class CPGroup:
    """The cp ranks: their process group (None: the world), this rank's index in it, the group's
    size and its members' global ranks in ring order (None on the meta device, nothing is sent)."""

    group: object
    rank: int
    size: int
    ranks: tuple[int, ...] | None = None

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


class RingPass:
    """One hop around the ring: ``send`` goes to the next rank while the previous rank's tensor of
    the same shape arrives (isend + irecv, both in flight while the caller computes); ``wait()``
    returns what arrived. ``tag`` keeps two kinds of hops in flight at once apart (K/V and dK/dV)."""

    def __init__(self, send: torch.Tensor, cp: CPGroup, tag: int) -> None:
        self.received = torch.empty_like(send)
        self.sent = send  # alive until the send completed
        self.works = []
        if send.is_meta:
            return
        self.works = [
            dist.irecv(self.received, src=cp.prev, group=cp.group, tag=tag),
            dist.isend(send, dst=cp.next, group=cp.group, tag=tag),
        ]

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _all_to_all(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Chunk j of ``x`` along dim 0 goes to rank j; chunk j of the result came from rank j."""
    out = torch.empty_like(x)
    if not x.is_meta:
        dist.all_to_all_single(out, x.contiguous(), group=cp.group)
    return out


def sequence_to_heads(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """(batch, heads, tokens/cp, d) on each rank -> (batch, heads/cp, tokens, d): rank r sends its
    tokens of heads chunk j to rank j and receives every rank's tokens of its own heads chunk."""
    b, h, t, d = x.shape
    parts = x.reshape(b, cp.size, h // cp.size, t, d).transpose(0, 1)  # (cp, b, h/cp, t, d): chunk j to rank j
    got = _all_to_all(parts.contiguous(), cp)  # chunk j: rank j's tokens of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * t, d)


def heads_to_sequence(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """The inverse: (batch, heads/cp, tokens, d) -> (batch, heads, tokens/cp, d)."""
    b, hc, tokens, d = x.shape
    parts = x.reshape(b, hc, cp.size, tokens // cp.size, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's tokens
    got = _all_to_all(parts.contiguous(), cp)  # chunk j: this rank's tokens of rank j's heads
    return got.transpose(0, 1).reshape(b, hc * cp.size, tokens // cp.size, d)


class _Exchange(torch.autograd.Function):
    """One of Ulysses' all-to-alls (``there``); its backward is the inverse all-to-all (``back``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup, there, back) -> torch.Tensor:
        ctx.cp, ctx.back = cp, back
        return there(x, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.back(grad, ctx.cp), None, None, None


def to_heads(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Sequence-sharded -> head-sharded, differentiable (Ulysses' first all-to-all, one per q, k, v)."""
    return _Exchange.apply(x, cp, sequence_to_heads, heads_to_sequence)


def to_sequence(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Head-sharded -> sequence-sharded, differentiable (Ulysses' last all-to-all, the output)."""
    return _Exchange.apply(x, cp, heads_to_sequence, sequence_to_heads)


class _PoolTokens(torch.autograd.Function):
    """Forward: all-reduce (sum) of the ranks' token sums. Backward: the upstream gradient times cp,
    no communication. Every cp rank computes the same loss from the same pool, and the strategy
    averages gradients over the cp ranks as over data-parallel ones; the whole pool's gradient
    reaching this rank's addend is the sum of the cp ranks' (identical) gradients, cp times one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        ctx.size = cp.size
        out = x.contiguous().clone()
        if not x.is_meta:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.size, None


def pool_tokens(token_sum: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """The sum over every rank's tokens of ``token_sum`` (this rank's), on every cp rank."""
    return _PoolTokens.apply(token_sum, cp)
