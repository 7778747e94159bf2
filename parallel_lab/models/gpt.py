"""A decoder-only transformer (GPT-2/Megatron layout, pre-LN), one module code at every size: a
2-layer model that trains on CPU in seconds and a trillion-parameter shape built on the meta device
for the planner (docs/gpt.md).

Layout, for the strategies that take a model apart (as the vit's, models/vit.py):
- an ``nn.Sequential`` of ``embed`` (token embedding ``tokens``, learned positions ``pos`` unless
  rotary), ``block0`` ... ``block{layers-1}``, ``head`` (final LayerNorm, then the output
  projection ``out`` or, tied, the token embedding's weight): a pipeline cuts between them;
- each block's attention has separate ``q``, ``k``, ``v`` Linears (``k``/``v`` of ``kv_heads``
  heads: grouped-query attention, Ainslie et al. arXiv 2305.13245) and an output ``proj``; its MLP
  is ``fc1`` then ``fc2`` (``mlp=swiglu``: ``gate`` and ``fc1`` both column-parallel, as Llama's
  w1/w3, Shazeer arXiv 2002.05202);
- the attention core (scores, causal mask, softmax, dropout, weighted sum) is ``attn.core``, the
  part selective recomputation recomputes.
Input: token ids (batch, seq), int64. Output: logits (batch, vocab, seq), the class dimension
second as ``torch.nn.functional.cross_entropy`` and ``argmax(1)`` take it, so the next-token loss
and the accuracy are the vit's code unchanged (labels (batch, seq)).
MoE (``moe_experts`` > 0): every ``moe_every``-th block's MLP (blocks moe_every-1, 2*moe_every-1,
..., as the vit's) is a mixture of experts (models/moe.py: router, top-k, the Switch/GShard
load-balancing loss in ``aux``), each expert the dense GELU MLP's shape; its sample's tokens are
one routing group.
Dropout where GPT-2 and Megatron put it: after the embeddings, on the attention probabilities,
after the attention's output projection and after the MLP's output (none after GELU). Masks are
keyed by each sample's tokens (models/dropout.py), as the vit's by its pixels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.models.counts import gpt_activation_bytes
from parallel_lab.models.dropout import SampleKeys
from parallel_lab.models.gpt_sizes import (  # noqa: F401  (re-exported: their torch-free home)
    DEFAULTS,
    MLPS,
    POSITIONS,
    PRESETS,
    ROPE_THETA,
    gpt_sizes,
    resolve_sizes,
)
from parallel_lab.models.layout import moe_block
from parallel_lab.models.moe import MOE_DEFAULTS, AuxLosses, MoEMLP
from parallel_lab.models.recompute import FULL, Recompute
from parallel_lab.models.specs import moe_options
from parallel_lab.models.vit import AttentionCore, Dropout, dropouts


def _normal(t: torch.Tensor, std: float) -> None:
    """N(0, std) init (GPT-2's 0.02); skipped on meta, where it has no values and costs time."""
    if not t.is_meta:
        nn.init.normal_(t, std=std)


def rotate(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding (Su et al. arXiv 2104.09864) on (batch, heads, seq, head_dim), the
    halves-paired form of GPT-NeoX and Llama: pair i is (x[i], x[i + head_dim/2]). ``positions``:
    each of the seq tokens' place in its sequence (None: 0 .. seq-1)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = ROPE_THETA ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    where = torch.arange(seq) if positions is None else positions
    angles = torch.outer(where.to(device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Embedding(nn.Module):
    """Token ids -> (batch, seq, hidden): the token embedding plus learned positions (rotary
    positions are applied in attention instead), then dropout. The layer that sees the tokens keys
    the samples' dropout masks."""

    takes_tokens = True  # models.sample_input: this layer's input is int64 token ids

    def __init__(self, vocab: int, hidden: int, seq: int, learned: bool, drop: Dropout, keys: SampleKeys | None):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        _normal(self.tokens.weight, 0.02)
        self.pos = nn.Parameter(torch.empty(seq, hidden)) if learned else None
        if self.pos is not None:
            _normal(self.pos, 0.02)
        self.drop = drop()
        self.keys = keys
        self.input_shape = (seq,)  # one sample: seq token ids (models.input_shape)
        # The (start, length) pieces of the sequence the ids hold, when they are not all of it from
        # 0 (a plain attribute; context parallelism hands each rank its tokens' ids,
        # strategies/cp/parallelize.py): their learned positions are those pieces' rows.
        self.pieces: list[tuple[int, int]] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training and self.keys is not None:
            self.keys.set(ids)
        x = self.tokens(ids)
        if self.pos is None:
            return self.drop(x)
        if self.pieces is None:
            return self.drop(x + self.pos[: ids.shape[1]])
        return self.drop(x + torch.cat([self.pos[start : start + length] for start, length in self.pieces]))


class CausalCore(AttentionCore):
    """softmax(q k^T / sqrt(head_dim) masked to the past) v: the vit's core with a causal mask and
    grouped-query attention (each kv head serves heads / kv_heads query heads). No parameters;
    recomputed in backward under trainer.recompute=selective."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]  # per rank under tp: heads / tp over kv_heads / tp
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        seq = q.shape[-2]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = (torch.matmul(q, k.transpose(-2, -1)) * self.scale).masked_fill(future, float("-inf"))
        return torch.matmul(self.drop(scores.softmax(dim=-1)), v)


class Attention(nn.Module):
    def __init__(self, s: dict[str, Any], drop: Dropout, recompute: Recompute) -> None:
        super().__init__()
        hidden, heads, kv = s["hidden"], s["heads"], s["kv_heads"]
        self.head_dim, self.rotary = hidden // heads, s["positions"] == "rotary"
        self.q = nn.Linear(hidden, hidden, bias=s["bias"])
        self.k = nn.Linear(hidden, kv * self.head_dim, bias=s["bias"])
        self.v = nn.Linear(hidden, kv * self.head_dim, bias=s["bias"])
        self.core = CausalCore(self.head_dim, drop, recompute)
        self.proj = nn.Linear(hidden, hidden, bias=s["bias"])
        self.drop = drop()
        # The rotary positions of the tokens x holds, when they are not 0 .. seq-1 (a plain
        # attribute, no state_dict key): a caller that feeds the block a subset of each sequence's
        # tokens names their places, so each is rotated by its own position.
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -1 heads: a column-parallel rank holding heads / tp of them runs the same code on its share;
        # the shapes come from q, k, v (under sequence parallelism x holds a slice of the tokens).
        q, k, v = (f(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.rotary:
            q, k = rotate(q, self.positions), rotate(k, self.positions)
        out = self.core(q, k, v).transpose(1, 2).flatten(2)
        return self.drop(self.proj(out))


class MLP(nn.Module):
    """fc2(GELU(fc1(x))), or Llama's fc2(SiLU(gate(x)) * fc1(x)) under mlp=swiglu; dropout after fc2."""

    def __init__(self, s: dict[str, Any], drop: Dropout) -> None:
        super().__init__()
        hidden, ffn = s["hidden"], s["ffn"]
        self.gate = nn.Linear(hidden, ffn, bias=s["bias"]) if s["mlp"] == "swiglu" else None
        self.fc1 = nn.Linear(hidden, ffn, bias=s["bias"])
        self.act = nn.SiLU() if self.gate is not None else nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden, bias=s["bias"])
        self.drop = drop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate(x)) * self.fc1(x) if self.gate is not None else self.act(self.fc1(x))
        return self.drop(self.fc2(h))


class Block(nn.Module):
    """Pre-LN: x + attn(norm1(x)), then + mlp(norm2(x)); recomputed whole under trainer.recompute=full.
    mlp: the block's MLP when it is not the dense one (an MoE layer, models/moe.py)."""

    def __init__(self, s: dict[str, Any], drop: Dropout, recompute: Recompute, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(s["hidden"])
        self.attn = Attention(s, drop, recompute)
        self.norm2 = nn.LayerNorm(s["hidden"])
        self.mlp = mlp if mlp is not None else MLP(s, drop)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recompute.run(FULL, self.compute, x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final LayerNorm, then logits over the vocabulary, (batch, vocab, seq). Tied: the projection is
    the embedding's own weight (held by reference, not registered here: one parameter, one
    state_dict key, ``embed.tokens.weight``)."""

    def __init__(self, hidden: int, vocab: int, tied_to: Embedding | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = None if tied_to is not None else nn.Linear(hidden, vocab, bias=False)
        if self.out is not None:
            _normal(self.out.weight, 0.02)
        self.__dict__["tied_to"] = tied_to  # a plain attribute: no second registration of the embedding

    def weight(self) -> torch.Tensor:
        return self.out.weight if self.out is not None else self.tied_to.tokens.weight

    def tie(self, holder: nn.Module) -> None:
        """Project with ``holder.tokens.weight`` from now on (a pipeline's last stage: its own copy
        of the embedding, strategies/pp/tied.py); held by reference, as the embedding is."""
        self.__dict__["tied_to"] = holder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight()).transpose(1, 2)


class GPT(nn.Sequential):
    """Token ids (batch, seq) -> ``layers`` pre-LN causal blocks -> logits (batch, vocab, seq)."""

    @property
    def activation_bytes_per_sample(self) -> int:
        """About what autograd saves per sample, for the memory check before a run (models/counts.py)."""
        return gpt_activation_bytes(self.sizes)

    def __init__(self, seed: int = 0, recompute: str = "none", **sizes: Any) -> None:
        """sizes: resolve_sizes' keys (missing ones take DEFAULTS) and the model.moe_* keys
        (models/specs.py MOE_DEFAULTS). seed: of the dropout masks."""
        super().__init__()
        moe = {key: default if sizes.get(key) is None else sizes[key] for key, default in MOE_DEFAULTS.items()}
        s = resolve_sizes(None, sizes)
        self.sizes = s
        self.input_shape = (s["seq"],)  # one sample: seq token ids (models.input_shape)
        keys = SampleKeys(seed) if s["dropout"] > 0 else None
        drop = dropouts(s["dropout"], keys)
        setting = Recompute(recompute, keys)
        embed = Embedding(s["vocab"], s["hidden"], s["seq"], s["positions"] == "learned", drop, keys)
        self.add_module("embed", embed)
        self.aux = AuxLosses()  # the MoE layers' load-balancing losses (a plain attribute)
        for i in range(s["layers"]):
            block = Block(s, drop, setting, self._moe(i, s, moe))
            residual_outputs = [block.attn.proj] + ([block.mlp.fc2] if isinstance(block.mlp, MLP) else [])
            for linear in residual_outputs:  # GPT-2's 1/sqrt(2 x layers) on residual outputs
                _normal(linear.weight, 0.02 / math.sqrt(2 * s["layers"]))
            self.add_module(f"block{i}", block)
        self.add_module("head", Head(s["hidden"], s["vocab"], embed if s["tied"] else None))
        # Top-level blocks that use one weight between them (the tied embedding): a wrapper that
        # gathers weights block by block must treat them as one (strategies/fsdp/rules.py).
        self.tied_children = ("embed", "head") if s["tied"] else ()

    def _moe(self, i: int, s: dict[str, Any], moe: dict[str, Any]) -> MoEMLP | None:
        """Block i's MoE MLP (hidden -> ffn -> hidden experts), or None where it is dense."""
        if not moe_block(i, moe["moe_experts"], moe["moe_every"]):
            return None
        args = (moe["moe_experts"], moe["moe_topk"], moe["moe_capacity_factor"], moe["moe_aux_weight"], i, self.aux)
        return MoEMLP(s["hidden"], s["ffn"], *args)


def build_gpt(cfg: Mapping[str, Any], device: str | torch.device = "meta", seed: int = 0) -> GPT:
    """The GPT a model config asks for (``{"preset": "gpt3_175b"}``, or ``layers``/``hidden``/...)
    on ``device``: on "meta" (the default) any size is built with no memory and no random numbers
    drawn, for the planner; elsewhere seeded, the same weights for the same seed."""
    sizes = {**gpt_sizes(cfg), **moe_options(cfg)}
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return GPT(**sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(seed=seed, **sizes)
