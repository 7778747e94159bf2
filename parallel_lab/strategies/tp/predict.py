"""What ``tp`` will hold and send, from the model's shapes alone (``parallel_lab.plan``).

The manual split (``layers.py``) keeps, on tp rank r, ``torch.chunk``'s r-th slice of a
column-parallel layer's weight and bias (dim 0) and of a row-parallel layer's weight (dim 1); the
row layer's bias and every other layer stay whole. torch's optimizer then holds its state for
exactly those tensors (Adam: two moments and a 4-byte step tensor each).

Communication per step (counter units: an all-reduce of B bytes counts 2B), batch b = the
per-step micro-batch (every tp rank sees the whole batch):
- a column layer's ``f`` all-reduces the gradient of its (whole) input in backward, unless that
  input is the data (no gradient flows there);
- a row layer's ``g`` all-reduces its output in forward; a row layer fed by replicated
  features (no column layer before it) also runs ``f`` on its whole input.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from parallel_lab.models.flops import layer_flops
from parallel_lab.strategies.memory import chunk_rows, predicted_optimizer_bytes


def _sharded_numels(model: torch.nn.Module, plan, tp: int, rank: int) -> list[int]:
    """Element count of every parameter rank holds after the split, model order."""
    column = {c for c, _ in plan if c}
    row = {r for _, r in plan}
    numels = []
    for name, p in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        if layer in column:
            held, _ = chunk_rows(p.shape[0], tp, rank)
            numels.append(p.numel() // p.shape[0] * held)
        elif layer in row and kind == "weight":
            held, _ = chunk_rows(p.shape[1], tp, rank)
            numels.append(p.numel() // p.shape[1] * held)
        else:
            numels.append(p.numel())
    return numels


def predict_tp_memory(cfg: DictConfig, model: torch.nn.Module, plan, rank: int) -> dict[str, int]:
    numels = _sharded_numels(model, plan, cfg.strategy.tp, rank % cfg.strategy.tp)
    return {
        "param_bytes": 4 * sum(numels),
        "grad_bytes": 4 * sum(numels),
        "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
    }


def _io_shapes(model: torch.nn.Module, names: set[str], batch: int) -> dict[str, tuple]:
    """Input and output shapes of the named layers for one batch (meta device forward)."""
    shapes: dict[str, tuple] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda mod, args, out, n=n: shapes.__setitem__(n, (args[0].shape, out.shape))
        )
        for n in names
    ]
    try:
        with torch.no_grad():
            model(torch.empty(batch, 3, 32, 32, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return shapes


def predict_tp_comm(cfg: DictConfig, model: torch.nn.Module, plan) -> dict[str, float]:
    if cfg.world_size < 2:
        return {}
    if cfg.strategy.tp < 2:
        return {"all_reduce": 2.0 * 4 * sum(p.numel() for p in model.parameters())}  # plain data parallel
    batch = cfg.trainer.global_batch // cfg.trainer.grad_accum // (cfg.strategy.get("replicate") or 1)
    names = {n for pair in plan for n in pair if n}
    shapes = _io_shapes(model, names, batch)
    first = next(n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False)))
    elems = 0
    for column, row in plan:
        if column is not None and column != first:
            elems += shapes[column][0].numel()  # f: backward all-reduce of the input's gradient
        if column is None:
            elems += shapes[row][0].numel()  # f on the replicated input of a lone row layer
        elems += shapes[row][1].numel()  # g: forward all-reduce of the partial sums
    comm = {"all_reduce": 2.0 * 4 * elems * cfg.trainer.grad_accum}
    if (cfg.strategy.get("replicate") or 1) > 1:  # dp x tp: each shard's gradients all-reduced over replicas
        comm["all_reduce"] += 2.0 * 4 * sum(_sharded_numels(model, plan, cfg.strategy.tp, 0))
    return comm


def tp_share(model: nn.Module, split_layers: list[str], degree: int) -> float:
    """A tp rank's share of the model's FLOPs: the split layers divided by the degree."""
    flops = layer_flops(model, 1)
    split = sum(f for name, f in flops.items() if name in split_layers)
    return (sum(flops.values()) - split + split / degree) / sum(flops.values())
