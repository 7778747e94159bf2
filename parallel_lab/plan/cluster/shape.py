"""The transformer the cluster planner prices: its sizes, parameter count and model FLOPs.

From the composed model config (``model=gpt`` with ``model.preset`` or explicit sizes; ``model=vit``
too) or from a table row (``bench published``, ``--csv``). FLOPs per token follow Narayanan et al.
(arXiv 2104.04473, eq. 3) and Korthikanti et al. (arXiv 2205.05198, section 6): 6 per parameter of
every GEMM weight (forward 2, backward 4), 12·s·h per layer for the attention scores and their
weighted sum, 6·V·h for the logits; recomputation adds the forward it repeats.
"""

from __future__ import annotations

import importlib.util
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


def _int(node, key: str, default=None):
    value = node.get(key, default)
    return default if value is None else int(value)


def gpt_module():
    """``parallel_lab.models.gpt`` where this checkout has it (model=gpt), else None."""
    return (
        importlib.import_module("parallel_lab.models.gpt")
        if importlib.util.find_spec("parallel_lab.models.gpt")
        else None
    )


def from_model_config(model: DictConfig) -> ModelShape:
    """The sizes of ``cfg.model``: the gpt's (its preset resolved by its own module) or the vit's."""
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
        )
    gpt = gpt_module()
    sizes = gpt.resolved_sizes(model) if gpt is not None and hasattr(gpt, "resolved_sizes") else model
    layers, hidden, heads = _int(sizes, "layers"), _int(sizes, "hidden"), _int(sizes, "heads")
    if None in (layers, hidden, heads):
        raise ConfigError(
            f"model={model.name} has no transformer sizes the cluster planner can read; "
            "use model=gpt (model.preset=<name> or model.layers/hidden/heads/seq/vocab) or model=vit"
        )
    return ModelShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_int(sizes, "kv_heads", heads),
        ffn=_int(sizes, "ffn", None) or _int(sizes, "mlp_hidden", None) or 4 * hidden,
        seq=_int(sizes, "seq", 2048),
        vocab=_int(sizes, "vocab", 51200),
        gated=str(sizes.get("mlp", "gelu")) == "swiglu",
        tied=bool(sizes.get("tied", True)),
        name=str(sizes.get("preset") or model.name),
    )
