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

from parallel_lab.models.dropout import SampleKeys
from parallel_lab.models.recompute import FULL, Recompute
from parallel_lab.models.vit import AttentionCore, Dropout, dropouts

# The tiny default: trains on CPU in seconds (conf/model/gpt.yaml writes it out). ffn null = 4 x
# hidden, kv_heads null = heads (plain multi-head attention).
DEFAULTS: dict[str, Any] = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": None,
    "ffn": None,
    "seq": 64,
    "vocab": 256,
    "tied": True,
    "positions": "learned",
    "mlp": "gelu",
    "bias": True,
    "dropout": 0.0,
}
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ROPE_THETA = 10_000.0  # RoFormer's base (Su et al. arXiv 2104.09864); Llama 3 uses 500,000 (no effect on shapes)


def _megatron(layers: int, hidden: int, heads: int, vocab: int = 51_200) -> dict[str, Any]:
    """A Megatron-LM GPT: 4h MLP of GELU, learned positions, tied embeddings, seq 2048, the GPT-2
    tokenizer's vocabulary padded to 51,200, biases."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": heads,
        "ffn": 4 * hidden,
        "seq": 2048,
        "vocab": vocab,
        "tied": True,
        "positions": "learned",
        "mlp": "gelu",
        "bias": True,
    }


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int) -> dict[str, Any]:
    """A Llama: SwiGLU MLP, rotary positions, untied embeddings, no biases (LayerNorm kept here
    where Llama has RMSNorm: h parameters per norm fewer, nothing else changes)."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn": ffn,
        "seq": seq,
        "vocab": vocab,
        "tied": False,
        "positions": "rotary",
        "mlp": "swiglu",
        "bias": False,
    }


# model.preset=<name>: published shapes. Each row's source beside it.
PRESETS: dict[str, dict[str, Any]] = {
    # Brown et al. 2020 (arXiv 2005.14165) Table 2.1, GPT-3 175B: 96 layers, d_model 12288, 96 heads,
    # n_ctx 2048; the GPT-2 BPE vocabulary of 50,257 (section 2.1 / GPT-2's tokenizer), tied, learned.
    "gpt3_175b": _megatron(96, 12288, 96, vocab=50_257),
    # Narayanan et al. 2021 (arXiv 2104.04473) Table 1 (heads, hidden, layers); seq 2048, vocab 51,200 (section 5).
    "narayanan_1.7b": _megatron(24, 2304, 24),
    "narayanan_3.6b": _megatron(30, 3072, 32),
    "narayanan_7.5b": _megatron(36, 4096, 32),
    "narayanan_18b": _megatron(40, 6144, 48),
    "narayanan_39b": _megatron(48, 8192, 64),
    "narayanan_76b": _megatron(60, 10240, 80),
    "narayanan_145b": _megatron(80, 12288, 96),
    "narayanan_310b": _megatron(96, 16384, 128),
    "narayanan_530b": _megatron(105, 20480, 128),
    "narayanan_1t": _megatron(128, 25600, 160),
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3 (heads, hidden, layers); seq 2048, vocab 51,200.
    "korthikanti_22b": _megatron(48, 6144, 64),
    "korthikanti_175b": _megatron(96, 12288, 96),
    "korthikanti_530b": _megatron(105, 20480, 128),
    "korthikanti_1t": _megatron(128, 25600, 160),
    # Llama 3 (arXiv 2407.21783) Table 3: layers, model dim, FFN dim, heads, 8 KV heads; seq 8192
    # (pre-training; section 3.4.2); vocab 128,256 (the released models' config.json; the paper says "128K").
    "llama3_8b": _llama(32, 4096, 32, 8, 14336, 8192, 128_256),
    "llama3_70b": _llama(80, 8192, 64, 8, 28672, 8192, 128_256),
    "llama3_405b": _llama(126, 16384, 128, 8, 53248, 8192, 128_256),
    # Generic shapes for advice tables. 1.3B: GPT-3 XL (Brown et al. Table 2.1: 24 layers, d_model
    # 2048) with Megatron's 16 heads of 128 and vocab 51,200. 7B/13B/70B: Llama 2 (Touvron et al.
    # arXiv 2307.09288, Table 1 and the released config.json: dims 4096/5120/8192, FFN 11008/13824/
    # 28672, seq 4096, vocab 32,000; 70B with 8 KV heads).
    "generic_1.3b": _megatron(24, 2048, 16),
    "generic_7b": _llama(32, 4096, 32, 32, 11008, 4096, 32_000),
    "generic_13b": _llama(40, 5120, 40, 40, 13824, 4096, 32_000),
    "generic_70b": _llama(80, 8192, 64, 8, 28672, 4096, 32_000),
}


def resolve_sizes(preset: str | None, given: dict[str, Any]) -> dict[str, Any]:
    """The model's sizes: DEFAULTS, then the preset's row, then every key given (not None).
    ffn and kv_heads, still None, become 4 x hidden and heads."""
    sizes = {**DEFAULTS, **(PRESETS[preset] if preset else {})}
    sizes.update({k: v for k, v in given.items() if k in DEFAULTS and v is not None})
    if sizes["ffn"] is None:
        sizes["ffn"] = 4 * sizes["hidden"]
    if sizes["kv_heads"] is None:
        sizes["kv_heads"] = sizes["heads"]
    return sizes


def _normal(t: torch.Tensor, std: float) -> None:
    """N(0, std) init (GPT-2's 0.02); skipped on meta, where it has no values and costs time."""
    if not t.is_meta:
        nn.init.normal_(t, std=std)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. arXiv 2104.09864) on (batch, heads, seq, head_dim), the
    halves-paired form of GPT-NeoX and Llama: pair i is (x[i], x[i + head_dim/2])."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = ROPE_THETA ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training and self.keys is not None:
            self.keys.set(ids)
        x = self.tokens(ids)
        return self.drop(x if self.pos is None else x + self.pos[: ids.shape[1]])


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: a column-parallel rank holding heads / tp of them runs the same code on its share.
        q, k, v = (f(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.rotary:
            q, k = rotate(q), rotate(k)
        out = self.core(q, k, v).transpose(1, 2).reshape(batch, seq, -1)
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
    """Pre-LN: x + attn(norm1(x)), then + mlp(norm2(x)); recomputed whole under trainer.recompute=full."""

    def __init__(self, s: dict[str, Any], drop: Dropout, recompute: Recompute) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(s["hidden"])
        self.attn = Attention(s, drop, recompute)
        self.norm2 = nn.LayerNorm(s["hidden"])
        self.mlp = MLP(s, drop)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight()).transpose(1, 2)


class GPT(nn.Sequential):
    """Token ids (batch, seq) -> ``layers`` pre-LN causal blocks -> logits (batch, vocab, seq)."""

    def __init__(self, seed: int = 0, recompute: str = "none", **sizes: Any) -> None:
        """sizes: resolve_sizes' keys (missing ones take DEFAULTS). seed: of the dropout masks."""
        super().__init__()
        s = resolve_sizes(None, sizes)
        self.sizes = s
        self.input_shape = (s["seq"],)  # one sample: seq token ids (models.input_shape)
        keys = SampleKeys(seed) if s["dropout"] > 0 else None
        drop = dropouts(s["dropout"], keys)
        setting = Recompute(recompute, keys)
        embed = Embedding(s["vocab"], s["hidden"], s["seq"], s["positions"] == "learned", drop, keys)
        self.add_module("embed", embed)
        for i in range(s["layers"]):
            block = Block(s, drop, setting)
            for linear in (block.attn.proj, block.mlp.fc2):  # GPT-2's 1/sqrt(2 x layers) on residual outputs
                _normal(linear.weight, 0.02 / math.sqrt(2 * s["layers"]))
            self.add_module(f"block{i}", block)
        self.add_module("head", Head(s["hidden"], s["vocab"], embed if s["tied"] else None))


def gpt_sizes(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes a model config asks for: ``preset``'s row (if any) under every key it sets."""
    return resolve_sizes(cfg.get("preset"), {key: cfg.get(key) for key in DEFAULTS})


def build_gpt(cfg: Mapping[str, Any], device: str | torch.device = "meta", seed: int = 0) -> GPT:
    """The GPT a model config asks for (``{"preset": "gpt3_175b"}``, or ``layers``/``hidden``/...)
    on ``device``: on "meta" (the default) any size is built with no memory and no random numbers
    drawn, for the planner; elsewhere seeded, the same weights for the same seed."""
    sizes = gpt_sizes(cfg)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return GPT(**sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(seed=seed, **sizes)
