"""``strategy.balance=time``: each cuttable block's forward+backward time, measured once in the
parent (``PPPlan.check_options``, before config.yaml is written) and written into
``strategy.block_times``, so every rank reads the same numbers and makes the same cut (a rank
measuring for itself could cut otherwise: timings differ between processes)."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.pp.plan import cuttable_blocks
from parallel_lab.threads import torch_threads

REPEATS = 5  # timed forward+backward passes of every block after one untimed pass; the median is kept


def micro_batch(cfg: DictConfig) -> int:
    """Samples per pipeline micro-batch: what each block runs on in the real step."""
    t, opts = cfg.trainer, cfg.strategy
    return max(1, t.global_batch // t.grad_accum // (opts.get("replicate") or 1) // opts.microbatches)


def time_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, repeats: int = REPEATS) -> list[float]:
    """Median seconds of one forward+backward of ``x``'s batch through each of ``blocks`` (run in
    order: each block's input is the one before's output; the first computes no input gradient,
    as in the model). Timed round-robin, every block once per repetition after one untimed pass:
    load that drifts during the measurement (another process taking the core, as on a shared
    machine) then lands on every block alike, where block by block it lands on whichever block is
    being timed and skews the cut (docs/pp.md)."""
    inputs = []
    with torch.no_grad():
        for block in blocks:
            inputs.append(x)
            x = block(x)
    samples: list[list[float]] = [[] for _ in blocks]
    for repeat in range(repeats + 1):
        for k, (block, inp) in enumerate(zip(blocks, inputs)):
            inp = inp.detach().requires_grad_(k > 0)
            start = time.perf_counter()
            out = block(inp)
            out.backward(torch.ones_like(out))
            if repeat:
                samples[k].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def measure_block_times(cfg: DictConfig, repeats: int = REPEATS) -> list[float]:
    """Median seconds of one forward+backward of a micro-batch through each cuttable block, in
    model order (``time_blocks``), on this process's CPU with the ranks' thread count
    (trainer.threads_per_rank)."""
    from parallel_lab.models import build_model, input_shape, sample_input

    with torch.random.fork_rng():  # the parent's own random state stays as it was
        model = build_model(cfg.model, cfg.trainer.seed).train()
    blocks = [nn.Sequential(*(model.get_submodule(n) for n in b)) for b in cuttable_blocks(model)]
    with torch_threads(cfg.trainer.threads_per_rank):
        generator = torch.Generator().manual_seed(0)
        x = sample_input(model, micro_batch(cfg), input_shape(model), device="cpu")  # token ids: zeros
        if x.is_floating_point():
            x = torch.randn(x.shape, generator=generator)
        return time_blocks(blocks, x, repeats)
