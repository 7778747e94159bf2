"""The transformer the cluster planner prices: its sizes, parameter count and model FLOPs.

From the composed model config (``model=gpt`` with ``model.preset`` or explicit sizes; ``model=vit``
too) or from a table row (``bench published``, ``--csv``). FLOPs per token follow Narayanan et al.
(arXiv 2104.04473, eq. 3) and Korthikanti et al. (arXiv 2205.05198, section 6): 6 per parameter of
every GEMM weight (forward 2, backward 4), 12·s·h per layer for the attention scores and their
weighted sum, 6·V·h for the logits; recomputation adds the forward it repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (a vit: its tokens and classes as seq and vocab)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # MLP width (SwiGLU: each of its two input projections)
    seq: int
    vocab: int
    gated: bool = False  # SwiGLU: three MLP matrices instead of two
    tied: bool = True  # the output layer reuses the embedding
    name: str = "model"
    rotary: bool = False  # rotary positions (no position embedding)
    fused_attention: bool = False  # a fused attention kernel (FlashAttention): no scores in memory
    family: str = "gpt"  # whose block the census counts: gpt or vit

    def gpt_sizes(self) -> dict:
        """The sizes models/gpt.py builds a block from."""
        from parallel_lab.models.gpt_sizes import resolve_sizes

        return resolve_sizes(
            None,
            {
                "layers": 1,
                "hidden": self.hidden,
                "heads": self.heads,
                "kv_heads": self.kv_heads,
                "ffn": self.ffn,
                "seq": self.seq,
                "vocab": self.vocab,
                "tied": self.tied,
                "mlp": "swiglu" if self.gated else "gelu",
                "positions": "rotary" if self.rotary else "learned",
                "bias": not self.gated,
            },
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """One block's weights: q, k, v, output projection, the MLP, two norms (weight + bias)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = h * (h + 2 * kv) + h * h
        mlp = (3 if self.gated else 2) * h * self.ffn
        return attention + mlp + 4 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()

    def flops_per_token(self, recompute: str = "none") -> float:
        """Model FLOPs per token of one training step; with recompute, the forward it repeats too
        (Megatron's hardware FLOPs: arXiv 2104.04473 eq. 3 counts full recomputation)."""
        gemm = 2.0 * self.layers * (self.layer_params() - 4 * self.hidden)
        attention = 4.0 * self.layers * self.seq * self.hidden
        logits = 2.0 * self.vocab * self.hidden
        total = 3 * (gemm + attention + logits)
        if recompute == "full":
            total += gemm + attention
        elif recompute == "selective":
            total += attention
        return total


def from_model_config(model: DictConfig, fused_attention: bool = False) -> ModelShape:
    """The sizes of ``cfg.model``: the gpt's (its preset resolved by models/gpt_sizes.py) or the vit's."""
    if model.name == "vit":
        from parallel_lab.models import vit_sizes
        from parallel_lab.models.vit import IMAGE

        sizes = vit_sizes(model)
        hidden = sizes["dim"]
        return ModelShape(
            layers=sizes["depth"],
            hidden=hidden,
            heads=sizes["heads"],
            kv_heads=sizes["heads"],
            ffn=int(hidden * sizes["mlp_ratio"]),
            seq=(IMAGE // sizes["patch"]) ** 2,
            vocab=model.num_classes,
            tied=False,
            name="vit",
            family="vit",
            fused_attention=fused_attention,
        )
    if model.name != "gpt":
        raise ConfigError(
            f"model={model.name} is not a transformer the cluster planner prices; use model=gpt "
            "(model.preset=<name> or model.layers/hidden/heads/seq/vocab) or model=vit"
        )
    from parallel_lab.models.gpt_sizes import gpt_sizes

    sizes = gpt_sizes(model)
    return ModelShape(
        layers=int(sizes["layers"]),
        hidden=int(sizes["hidden"]),
        heads=int(sizes["heads"]),
        kv_heads=int(sizes["kv_heads"]),
        ffn=int(sizes["ffn"]),
        seq=int(sizes["seq"]),
        vocab=int(sizes["vocab"]),
        gated=sizes["mlp"] == "swiglu",
        tied=bool(sizes["tied"]),
        rotary=sizes["positions"] == "rotary",
        name=str(model.get("preset") or model.name),
        fused_attention=bool(fused_attention),
    )
