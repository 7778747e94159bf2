"""Context parallelism on the vit and the gpt (torchtitan's separate parallelize step): the same
single-device model, changed in place on every cp rank so that rank r holds its share of every
sample's T tokens: on the vit (T = (32/patch)^2) and under the gpt's Ulysses tokens
[r*T/cp, (r+1)*T/cp); under the gpt's ring chunks r and 2cp-1-r of 2cp (causal.py: the causal work
balanced, ``token_pieces``).

- ``embed``: its output is sliced to this rank's tokens (a forward hook; the patch convolution and
  the position embedding are cheap, and only this rank's tokens receive gradient);
- each block's ``attn.core`` (``ContextParallelCore``): every token's query must see every token's
  key, the one place tokens meet: ring attention (``ring.py``), Ulysses' all-to-alls around the
  local attention (``comm.py``), or DeepSpeed's ``DistributedAttention`` around it;
- ``head`` (``ContextParallelHead``): the vit has no class token; it mean-pools its tokens, so each
  rank sums its own, the sums are all-reduced (``comm.pool_tokens``) and divided by T: the mean
  single takes, on every cp rank. LayerNorm, the MLP, the residuals and the q/k/v/proj Linears act
  token by token and run unchanged on the slice.

The gpt (``parallelize_gpt``): ``embed`` takes the rank's token ids (a forward pre-hook) and adds
their own learned positions (``embed.pieces``), so each token keeps its own; each block's
``attn.positions`` names the rank's tokens' places for the rotary embedding; the core is causal (the ring: causal.py;
Ulysses' local core holds every token of its heads, in order, and masks as single does); the head
acts token by token, so the loss is the cross-entropy of the rank's tokens against their labels
(the strategy slices the labels, cp/strategy.py): the cp ranks' equal shares average to single's.

Parameter names and state_dict keys do not change (the replaced modules keep the originals'
children; the attention core has no parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel_lab.models.gpt import GPT
from parallel_lab.strategies.cp.causal import causal_ring_attention
from parallel_lab.strategies.cp.comm import TOKENS, CPGroup, pool_tokens, to_heads, to_sequence
from parallel_lab.strategies.cp.ring import ring_attention


class ContextParallelCore(nn.Module):
    """The attention core of one block on this rank's tokens, (batch, heads, tokens/cp, head_dim)
    in and out: ``impl`` ring | ulysses | deepspeed. ``local``: the model's own core (no
    parameters), which Ulysses and DeepSpeed run on all tokens of heads/cp heads. ``causal``: the
    gpt's (the ring then causal.py's load-balanced one)."""

    def __init__(self, local: nn.Module, cp: CPGroup, impl: str, causal: bool = False) -> None:
        super().__init__()
        self.local, self.cp, self.impl = local, cp, impl
        self.ring = causal_ring_attention if causal else ring_attention
        self.distributed = _deepspeed_attention(local, cp) if impl == "deepspeed" else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.impl == "ring":
            return self.ring(q, k, v, self.local.scale, self.cp)
        if self.distributed is not None and not q.is_meta:  # DeepSpeed's layout: (batch, tokens, heads, d)
            return self.distributed(*(t.transpose(1, 2) for t in (q, k, v)), 0).transpose(1, 2)
        heads = [to_heads(t, self.cp) for t in (q, k, v)]
        return to_sequence(self.local(*heads), self.cp)


class _TokensFirst(nn.Module):
    """The model's core, (batch, heads, tokens, d), called in DeepSpeed's (batch, tokens, heads, d)."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.core(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _deepspeed_attention(local: nn.Module, cp: CPGroup) -> nn.Module:
    """DeepSpeed-Ulysses' own layer around the local core, in its batch-first layout (batch_dim_idx
    0): it scatters dim 2 (heads) and gathers dim 1 (tokens), and back after the core."""
    from deepspeed.sequence.layer import DistributedAttention

    return DistributedAttention(_TokensFirst(local), cp.group, scatter_idx=2, gather_idx=1)


class ContextParallelHead(nn.Module):
    """The vit's head (LayerNorm, mean over tokens, Linear) on this rank's tokens: the tokens' sum,
    pooled over the cp ranks and divided by all tokens. Keeps the head's ``norm`` and ``fc``."""

    def __init__(self, head: nn.Module, cp: CPGroup) -> None:
        super().__init__()
        self.norm, self.fc, self.cp = head.norm, head.fc, cp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = pool_tokens(self.norm(x).sum(dim=TOKENS), self.cp)
        return self.fc(pooled / (x.shape[TOKENS] * self.cp.size))


def blocks(model: nn.Module) -> list[nn.Module]:
    return [child for name, child in model.named_children() if name.startswith("block") and hasattr(child, "attn")]


def parallelize_vit(model: nn.Module, cp: CPGroup, impl: str) -> nn.Module:
    """Shard the vit's tokens over the cp ranks, in place (the module docstring); returns it."""
    cp_rank, size = cp.rank, cp.size
    # contiguous: the first block saves its own slice, not a view of every token's storage
    model.embed.register_forward_hook(lambda _m, _a, out: out.chunk(size, TOKENS)[cp_rank].contiguous())
    for block in blocks(model):
        block.attn.core = ContextParallelCore(block.attn.core, cp, impl)
    model.head = ContextParallelHead(model.head, cp)
    return model


def token_pieces(seq: int, cp: int, rank: int, impl: str) -> list[tuple[int, int]]:
    """The (start, length) pieces of a gpt sequence of ``seq`` tokens cp rank ``rank`` holds: under
    the ring chunks rank and 2cp-1-rank of 2cp (the causal work balanced, cp/causal.py), under
    Ulysses and DeepSpeed the rank-th of cp (their all-to-all gathers the tokens in rank order)."""
    if impl != "ring":
        return [(rank * (seq // cp), seq // cp)]
    chunk = seq // (2 * cp)
    return [(rank * chunk, chunk), ((2 * cp - 1 - rank) * chunk, chunk)]


def gather_tokens(local: torch.Tensor, cp: CPGroup, impl: str, dim: int = -1) -> torch.Tensor:
    """The whole sequence of ``local`` (this rank's token_pieces along ``dim``) gathered from the cp
    ranks, each rank's pieces put in their places (collective over ``cp.group``): the gpt's logits
    at evaluation, so that every cp rank scores every token."""
    parts = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(parts, local.contiguous(), group=cp.group)
    shape = list(local.shape)
    seq = shape[dim] = shape[dim] * cp.size
    whole = local.new_empty(shape)
    for rank, part in enumerate(parts):
        at = 0
        for start, length in token_pieces(seq, cp.size, rank, impl):
            whole.narrow(dim, start, length).copy_(part.narrow(dim, at, length))
            at += length
    return whole


def take_tokens(x: torch.Tensor, pieces: list[tuple[int, int]], dim: int = TOKENS) -> torch.Tensor:
    """This rank's tokens of ``x``: the (start, length) pieces along ``dim``, in order, contiguous."""
    parts = [x.narrow(dim, start, length) for start, length in pieces]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].contiguous()


def parallelize_gpt(model: nn.Module, cp: CPGroup, impl: str) -> list[tuple[int, int]]:
    """Shard the gpt's tokens over the cp ranks, in place (the module docstring); returns this
    rank's pieces of the sequence, which the strategy takes of the labels."""
    pieces = token_pieces(model.sizes["seq"], cp.size, cp.rank, impl)
    positions = torch.cat([torch.arange(start, start + length) for start, length in pieces])
    # the rank's token ids enter the embedding (as Megatron-Core slices its batch): under strategy=tp
    # the vocab-parallel lookup then sums only the rank's tokens (tp/vocab.py)
    model.embed.register_forward_pre_hook(lambda _m, args: (take_tokens(args[0], pieces, 1),))
    model.embed.pieces = pieces
    for block in blocks(model):
        block.attn.positions = positions
        block.attn.core = ContextParallelCore(block.attn.core, cp, impl, causal=True)
    return pieces


def parallelize(model: nn.Module, cp: CPGroup, impl: str) -> list[tuple[int, int]] | None:
    """The model's tokens sharded over the cp ranks (vit or gpt), in place; the gpt's pieces."""
    if isinstance(model, GPT):
        return parallelize_gpt(model, cp, impl)
    parallelize_vit(model, cp, impl)
    return None
