"""``strategy=tp strategy.cp=N`` on the gpt in the parent: context parallelism inside Megatron's
vocab-parallel split (tp/vocab.py), what it refuses and what the planner predicts of it. Torch-free
at import (the parent refuses bad input before torch is imported).

The mesh is replicate x cp x tp (strategies/mesh.py, tp innermost): a tp group is a run of tp
consecutive ranks holding the same tokens; the cp ranks of one tp coordinate hold the same shards
of different tokens (the gpt's causal ring: chunks r and 2cp-1-r of 2cp, cp/parallelize.py) and
their attention runs on the tp rank's heads/tp (and kv_heads/tp) heads. Megatron-Core lays out its
CP groups the same way (tp innermost, cp next to it)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError


def check_tp_context(opts: DictConfig, cfg: DictConfig) -> None:
    """One line for every ``strategy=tp`` configuration with strategy.cp > 1 this project cannot
    run, before the degrees are checked; cp's own rules (cp/rules.py ``check_context``: the
    sequence's chunks, Ulysses' heads of a tp rank, dropout, recomputation, precision) run after
    the split's (tp/rules.py)."""
    cp, tp = opts.cp, opts.tp
    if cp == 1:
        return
    if cfg.model.name != "gpt":
        fix = f"strategy=fsdp strategy.cp={cp} strategy.tp={tp}" if cfg.model.name == "vit" else "model=gpt"
        raise ConfigError(
            f"strategy=tp strategy.cp={cp} is built on model=gpt (its vocab-parallel split), not "
            f"model={cfg.model.name}; use {fix}"
        )
    refused = (
        (str(opts.impl) != "manual", f"strategy.impl={opts.impl}", "strategy.impl=manual"),
        (tp < 2, f"strategy.tp={tp}", f"strategy=ddp strategy.cp={cp} (context parallelism without tp)"),
        (bool(opts.sequence_parallel), "strategy.sequence_parallel=true", "strategy.sequence_parallel=false"),
        (opts.ep != 1, f"strategy.ep={opts.ep}", "strategy.ep=1"),
        (str(opts.cp_impl) == "deepspeed", "strategy.cp_impl=deepspeed", "strategy.cp_impl=ring or ulysses"),
    )
    for bad, value, fix in refused:
        if bad:
            raise ConfigError(f"{value} with strategy=tp strategy.cp={cp} is not built on model=gpt; use {fix}")


def tp_context_comm(cfg: DictConfig, model) -> dict[str, float]:
    """What cp adds per step to a tp rank's bytes beyond Megatron's formula at seq/cp tokens
    (gpt_predict.py; the embedding too sums only the rank's tokens' lookups, cp/parallelize.py):
    the ring's (or Ulysses') attention bytes on the tp rank's heads (cp/rules.py ``context_comm``)."""
    from parallel_lab.strategies.cp.rules import context_comm

    return context_comm(cfg, model, cfg.strategy.get("replicate") or 1, cfg.strategy.tp)
