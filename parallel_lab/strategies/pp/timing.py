"""``strategy.balance=time``: each cuttable block's forward+backward time, measured once in the
parent (``PPPlan.check_options``, before config.yaml is written) and written into
``strategy.block_times``, so every rank reads the same numbers and makes the same cut (a rank
measuring for itself could cut otherwise: timings differ between processes)."""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig

from parallel_lab.strategies.planning import SAMPLE_SHAPE
from parallel_lab.strategies.pp.plan import cuttable_blocks

REPEATS = 5  # timed forward+backward passes per block after one untimed warm-up; the median is kept


def micro_batch(cfg: DictConfig) -> int:
    """Samples per pipeline micro-batch: what each block runs on in the real step."""
    t, opts = cfg.trainer, cfg.strategy
    return max(1, t.global_batch // t.grad_accum // (opts.get("replicate") or 1) // opts.microbatches)


def measure_block_times(cfg: DictConfig, repeats: int = REPEATS) -> list[float]:
    """Median seconds of one forward+backward of a micro-batch through each cuttable block, in
    model order, on this process's CPU with the ranks' thread count (trainer.threads_per_rank)."""
    from parallel_lab.models import build_model

    with torch.random.fork_rng():  # the parent's own random state stays as it was
        model = build_model(cfg.model, cfg.trainer.seed).train()
    blocks = [torch.nn.Sequential(*(model.get_submodule(n) for n in b)) for b in cuttable_blocks(model)]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cfg.trainer.threads_per_rank))
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(micro_batch(cfg), *SAMPLE_SHAPE, generator=generator)
        seconds = []
        for block in blocks:
            samples = []
            for _ in range(repeats + 1):
                inp = x.detach().requires_grad_(block is not blocks[0])
                start = time.perf_counter()
                out = block(inp)
                out.backward(torch.ones_like(out))
                samples.append(time.perf_counter() - start)
            seconds.append(statistics.median(samples[1:]))
            with torch.no_grad():
                x = block(x)
        return seconds
    finally:
        torch.set_num_threads(threads)
