"""Parent-side rules of ``strategy=tp model=gpt`` (the split: tp/vocab.py): each rank holds whole
query heads, whole key/value heads, ffn/tp hidden features and V/tp rows of the vocabulary, so
strategy.tp must divide each; sequence parallelism needs whole tokens per rank. Torch-free."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.models.gpt_sizes import gpt_sizes

# (size key, what a rank holds whole of it)
SPLIT_SIZES = (
    ("heads", "query heads"),
    ("kv_heads", "key/value heads (grouped-query attention)"),
    ("ffn", "MLP hidden features"),
    ("vocab", "vocabulary rows of the embedding and the output projection"),
)


def check_gpt_split(cfg: DictConfig, opts: DictConfig) -> None:
    """Refuse, in one line, a gpt the manual vocab-parallel split cannot divide over strategy.tp."""
    if opts.impl != "manual":
        raise ConfigError(
            f"strategy.impl={opts.impl} with model=gpt: the vocab-parallel embedding and cross-entropy are "
            "the manual split's (tp/vocab.py); use strategy.impl=manual"
        )
    experts = cfg.model.get("moe_experts") or 0
    if experts:  # VocabParallelLoss is the cross-entropy alone: the MoE layers' aux loss would be lost
        raise ConfigError(
            f"model.moe_experts={experts} with strategy=tp on model=gpt: the vocab-parallel loss does not add "
            "the load-balancing loss; use model=vit for tp x MoE or model.moe_experts=0"
        )
    sizes, tp = gpt_sizes(cfg.model), opts.tp
    for key, what in SPLIT_SIZES:
        if sizes[key] % tp:
            raise ConfigError(
                f"strategy.tp={tp} does not divide model.{key}={sizes[key]} (each rank holds whole {what}); "
                f"use a strategy.tp that divides {sizes[key]}"
            )
    if opts.sequence_parallel and opts.tp < 2:
        raise ConfigError(
            f"strategy.sequence_parallel=true needs strategy.tp > 1 (got strategy.tp={opts.tp}); "
            "use strategy.tp=2 or strategy.sequence_parallel=false"
        )
    if opts.sequence_parallel and sizes["seq"] % tp:
        raise ConfigError(
            f"strategy.tp={tp} does not divide model.seq={sizes['seq']} (strategy.sequence_parallel=true: "
            f"each rank holds whole tokens); use a strategy.tp that divides {sizes['seq']}"
        )
