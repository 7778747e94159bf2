"""``strategy.balance=time``: each cuttable block's time, measured once in the parent
(``PPPlan.check_options``, before config.yaml is written) and written into
``strategy.block_times``, so every rank reads the same numbers and makes the same cut (a rank
measuring for itself could cut otherwise: timings differ between processes).

A block is timed as the stage that holds it runs it: its forward, then its backward as the
schedule splits it (zero bubble under the manual loop: B with the weight GEMMs put aside, then W
running them, pp/zero_bubble.py; Qi et al., arXiv 2401.10241), the first block computing no
input gradient (the model's input has none) and the last block's forward followed by the loss,
which the last stage computes. The embedding and the head are blocks of their own (models/layout.py),
so each is counted on the stage that holds it."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.pp.plan import cuttable_blocks
from parallel_lab.strategies.pp.schedules import SPLIT_BACKWARD
from parallel_lab.strategies.pp.zero_bubble import DeferredWeights
from parallel_lab.threads import torch_threads

REPEATS = 5  # timed passes of every block after one untimed pass; the median is kept
Loss = Callable[[torch.Tensor], torch.Tensor]


def micro_batch(cfg: DictConfig) -> int:
    """Samples per pipeline micro-batch: what each block runs on in the real step."""
    t, opts = cfg.trainer, cfg.strategy
    return max(1, t.global_batch // t.grad_accum // (opts.get("replicate") or 1) // opts.microbatches)


def splits_backward(opts: DictConfig) -> bool:
    """Whether the run's backward is two passes, B and W (zero bubble in the manual loop)."""
    return str(opts.schedule) in SPLIT_BACKWARD and str(opts.get("impl", "manual")) == "manual"


def class_loss(out: torch.Tensor) -> torch.Tensor:
    """The training loss's cost on the last block's output: cross-entropy over its classes."""
    from parallel_lab.models import loss_target

    return F.cross_entropy(out, loss_target(out))


def time_blocks(
    blocks: Sequence[nn.Module], x: torch.Tensor, repeats: int = REPEATS, split: bool = False, loss: Loss | None = None
) -> list[float]:
    """Median seconds of one forward and backward of ``x``'s batch through each of ``blocks``
    (``time_passes``' samples, each repetition's passes summed)."""
    return [statistics.median(sum(r) for r in s) for s in _samples(blocks, x, repeats, split, loss)]


def time_passes(
    blocks: Sequence[nn.Module], x: torch.Tensor, repeats: int = REPEATS, split: bool = True, loss: Loss | None = None
) -> tuple[list[float], list[list[float]]]:
    """Each block's median total (``time_blocks``) and its median F, B and W seconds (W 0 unless
    ``split``): zero bubble's order is built from the latter (pp/zb_orders.py), the cut from the former."""
    samples = _samples(blocks, x, repeats, split, loss)
    totals = [statistics.median(sum(r) for r in s) for s in samples]
    return totals, [[statistics.median(r[k] for r in s) for k in range(3)] for s in samples]


def _samples(
    blocks: Sequence[nn.Module], x: torch.Tensor, repeats: int, split: bool, loss: Loss | None
) -> list[list[tuple[float, float, float]]]:
    """Per block, per repetition: the seconds of its forward, its backward (B) and its W (0 unless
    ``split``: the backward is B then W, ``DeferredWeights``); ``loss``: applied to the last
    block's output inside its timed forward. Blocks run in order, each one's input the one
    before's output, the first computing no input gradient (as in the model). Timed round-robin,
    every block once per repetition after one untimed pass: load that drifts during the
    measurement (another process taking the core, as on a shared machine) then lands on every
    block alike, where block by block it lands on whichever block is being timed and skews the cut
    (docs/pp.md)."""
    inputs = []
    with torch.no_grad():
        for block in blocks:
            inputs.append(x)
            x = block(x)
    deferred = [DeferredWeights(block) if split else None for block in blocks]
    samples: list[list[tuple[float, float, float]]] = [[] for _ in blocks]
    for repeat in range(repeats + 1):
        for k, (block, inp) in enumerate(zip(blocks, inputs)):
            inp = inp.detach().requires_grad_(k > 0)
            marks = [time.perf_counter()]
            out = block(inp)
            if loss is not None and k == len(blocks) - 1:
                out = loss(out)
            marks.append(time.perf_counter())
            _backward(out, deferred[k], marks)
            if repeat:
                samples[k].append(tuple(b - a for a, b in zip(marks, marks[1:])))
    return samples


def _backward(out: torch.Tensor, deferred: DeferredWeights | None, marks: list[float]) -> None:
    """The block's backward as the loop runs it: one pass, or B (weight GEMMs put aside) then W;
    ``marks`` gains the end of B and of W (W's 0 s when not split)."""
    if deferred is None:
        out.backward(torch.ones_like(out))
        marks += [time.perf_counter()] * 2
        return
    with deferred.pass_of(0):
        out.backward(torch.ones_like(out))
    marks.append(time.perf_counter())
    deferred.run(0)
    marks.append(time.perf_counter())


def measure_block_times(cfg: DictConfig, repeats: int = REPEATS) -> list[float]:
    """Median seconds of one micro-batch through each cuttable block, in model order, as its
    stage runs it (``time_blocks``: the backward split as the schedule splits it, the loss on the
    last block), on this process's CPU with the ranks' thread count (trainer.threads_per_rank)."""
    return measure_pass_times(cfg, repeats)[0]


def measure_pass_times(cfg: DictConfig, repeats: int = REPEATS) -> tuple[list[float], list[list[float]]]:
    """``measure_block_times`` and, from the same passes, each block's median F, B, W
    (``time_passes``): zero bubble's ``strategy.pass_times``."""
    from parallel_lab.models import build_model, input_shape, sample_input

    with torch.random.fork_rng():  # the parent's own random state stays as it was
        model = build_model(cfg.model, cfg.trainer.seed).train()
    blocks = [nn.Sequential(*(model.get_submodule(n) for n in b)) for b in cuttable_blocks(model)]
    with torch_threads(cfg.trainer.threads_per_rank):
        generator = torch.Generator().manual_seed(0)
        x = sample_input(model, micro_batch(cfg), input_shape(model), device="cpu")  # token ids: zeros
        if x.is_floating_point():
            x = torch.randn(x.shape, generator=generator)
        return time_passes(blocks, x, repeats, splits_backward(cfg.strategy), class_loss)
