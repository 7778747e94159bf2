"""A small vision transformer for CIFAR-10 (Dosovitskiy et al. 2020, pre-LN blocks), ~0.14M
parameters at the defaults.

Layout, for the strategies that take a model apart (docs/vit.md):
- an ``nn.Sequential`` of coarse blocks, ``embed``, ``block0`` ... ``block{depth-1}``, ``head``:
  a pipeline cuts between them;
- each block's attention has separate ``q``, ``k``, ``v`` Linears (a column-parallel split by heads
  is a split of each one's output features) and an output ``proj`` (row-parallel); its MLP is
  ``fc1`` (column) then ``fc2`` (row), as in the cnn's classifier;
- the attention core (scores, softmax, dropout, weighted sum) is its own module, ``attn.core``,
  the part selective recomputation recomputes.
Attention is written as explicit matmuls and a softmax, not ``F.scaled_dot_product_attention``:
what autograd saves for them is what the planner counts on the meta device (plan/predict.py).
The tokens are mean-pooled, no class token: 64 tokens at patch 4, a length a sequence-parallel
split divides. Dropout (off, an Identity, at the default 0.0) draws each sample's mask from the
sample itself (models/dropout.py): the same masks under every data-parallel split.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
import torch.nn as nn

from parallel_lab.models.counts import ACTIVATION_BYTES_PER_SAMPLE
from parallel_lab.models.dropout import SampleDropout, SampleKeys
from parallel_lab.models.layout import moe_block, vit_widths
from parallel_lab.models.moe import MOE_DEFAULTS, AuxLosses, MoEMLP
from parallel_lab.models.recompute import FULL, SELECTIVE, Recompute
from parallel_lab.models.specs import IMAGE, VIT_DEFAULTS

# The vit's sizes: the one home of their defaults (config/schema.py ModelConfig leaves them null).
DEFAULTS = VIT_DEFAULTS  # the sizes' one home is the package root (torch-free: the parent validates them)


Dropout = Callable[[], nn.Module]  # makes the model's next dropout layer


def dropouts(p: float, keys: SampleKeys) -> Dropout:
    """A maker of the model's dropout layers, each its own site; Identity at p=0 (no random
    numbers drawn, no mask saved: the model then trains bit for bit as without dropout)."""
    sites = itertools.count()
    return lambda: SampleDropout(p, keys, next(sites)) if p > 0 else nn.Identity()


class PatchEmbedding(nn.Module):
    """Image -> tokens: a patch x patch convolution with stride patch (a Linear on each patch),
    plus a learned position embedding."""

    def __init__(self, dim: int, patch: int, drop: Dropout, keys: SampleKeys | None) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.empty(1, (IMAGE // patch) ** 2, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.drop = drop()
        self.keys = keys  # None without dropout: nothing to key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.keys is not None:  # the one layer that sees the pixels keys the samples
            self.keys.set(x)
        # Contiguous (batch, tokens, dim): the transposed view's strides would carry through every
        # residual add, each block then ~15% slower on CPU, and a pipeline's later stages (fed
        # contiguous tensors by recv) faster than its first (docs/pp.md, "Measured idle").
        tokens = self.proj(x).flatten(2).transpose(1, 2).contiguous()
        return self.drop(tokens + self.pos)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v on (batch, heads, tokens, head_dim): no parameters.
    Recomputed in backward under trainer.recompute=selective (models/recompute.py)."""

    def __init__(self, head_dim: int, drop: Dropout = nn.Identity, recompute: Recompute | None = None) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.drop = drop()
        self.recompute = recompute or Recompute()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.recompute.run(SELECTIVE, self.attend, q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        return torch.matmul(self.drop(scores.softmax(dim=-1)), v)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, drop: Dropout, recompute: Recompute) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.core = AttentionCore(dim // heads, drop, recompute)
        self.proj = nn.Linear(dim, dim)
        self.drop = drop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_dim = self.proj.in_features // self.heads
        # -1 heads: a column-parallel rank holding heads / tp of them runs the same code on its share;
        # the shapes come from q, k, v (under sequence parallelism x holds a slice of the tokens).
        q, k, v = (f(x).unflatten(-1, (-1, head_dim)).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = self.core(q, k, v).transpose(1, 2).flatten(2)
        return self.drop(self.proj(out))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: Dropout, after_act: bool = True) -> None:
        """after_act: a dropout after GELU (placement vit); without it ``drop1`` is an Identity."""
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = drop() if after_act else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = drop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN: x + attn(norm1(x)), then + mlp(norm2(x)). Recomputed whole in backward under
    trainer.recompute=full (only its input kept), its attention core alone under selective."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        drop: Dropout,
        recompute: Recompute,
        mlp: nn.Module | None = None,
        placement: str = "vit",
    ) -> None:
        """mlp: the block's MLP when it is not the dense one (an MoE layer, models/moe.py).
        placement: model.dropout_placement, the dense MLP's (``MLP``)."""
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, drop, recompute)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = mlp if mlp is not None else MLP(dim, hidden, drop, after_act=placement == "vit")
        self.recompute = recompute  # shared by the model's blocks: a plain attribute, no state_dict key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recompute.run(FULL, self.compute, x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """LayerNorm, mean over the tokens, Linear to the classes."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class ViT(nn.Sequential):
    """32x32x3 -> (32/patch)^2 tokens of dim -> depth pre-LN blocks -> mean-pooled classifier."""

    # Bytes autograd saves for backward per sample of batch at the default sizes, for the memory
    # check before a run (config/resources.py); tests/unit/test_resources.py recounts them.
    activation_bytes_per_sample = ACTIVATION_BYTES_PER_SAMPLE["vit"]

    def __init__(
        self,
        num_classes: int = 10,
        width: float = 1.0,
        norm: str = "group",
        patch: int = DEFAULTS["patch"],
        dim: int = DEFAULTS["dim"],
        depth: int = DEFAULTS["depth"],
        heads: int = DEFAULTS["heads"],
        mlp_ratio: float = DEFAULTS["mlp_ratio"],
        dropout: float = DEFAULTS["dropout"],
        dropout_placement: str = DEFAULTS["dropout_placement"],
        seed: int = 0,
        recompute: str = "none",
        moe_experts: int = MOE_DEFAULTS["moe_experts"],
        moe_topk: int = MOE_DEFAULTS["moe_topk"],
        moe_every: int = MOE_DEFAULTS["moe_every"],
        moe_aux_weight: float = MOE_DEFAULTS["moe_aux_weight"],
        moe_capacity_factor: float | None = MOE_DEFAULTS["moe_capacity_factor"],
    ) -> None:
        """seed: of the dropout masks (models/dropout.py), build_model's seed. recompute: none |
        selective | full (models/recompute.py; set_recompute changes it after the build).
        moe_experts > 0: every moe_every-th block's MLP (blocks moe_every-1, 2*moe_every-1, ...,
        V-MoE's layout) is a mixture of that many experts (models/moe.py). dropout_placement: vit |
        gpt (models/specs.py ``VIT_PLACEMENTS``)."""
        super().__init__()
        del norm  # LayerNorm always: validate_model_config refuses batch/syncbatch for the vit
        dim, hidden = vit_widths(dim, heads, width, mlp_ratio)
        keys = SampleKeys(seed) if dropout > 0 else None
        drop = dropouts(dropout, keys)
        setting = Recompute(recompute, keys)
        self.add_module("embed", PatchEmbedding(dim, patch, drop, keys))
        self.aux = AuxLosses()  # the MoE layers' load-balancing losses (a plain attribute)
        for i in range(depth):
            moe = moe_block(i, moe_experts, moe_every)
            args = (dim, hidden, moe_experts, moe_topk, moe_capacity_factor, moe_aux_weight, i, self.aux)
            mlp = MoEMLP(*args) if moe else None
            self.add_module(f"block{i}", Block(dim, heads, hidden, drop, setting, mlp, dropout_placement))
        self.add_module("head", Head(dim, num_classes))
