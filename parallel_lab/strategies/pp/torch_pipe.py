"""``strategy.impl=torch``: the same chunks run by torch.distributed.pipelining (one
``PipelineStage`` per chunk, global chunk g on pipeline rank g % p: torch's "loop" placement); in
bf16 each chunk computes as the manual loop's does (``RunChunk``).

Busy time: each stage's ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` are timed (torch receives and sends outside them), the same
measure as the manual loop's."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from parallel_lab.comm.counter import trace_label
from parallel_lab.protocol import IDLE_LABEL

# strategy.schedule -> torch's class (pp/rules.py IMPLS lists what impl=torch runs).
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
MULTI = ("interleaved_1f1b", "zero_bubble")  # schedules that take a list of stages


class OwnOutput(nn.Module):
    """A chunk's output as a contiguous tensor of its own: torch's stages isend it as it is, and
    gloo sends only contiguous tensors (the vit's tokens keep the embed's transposed layout through
    every elementwise op); zero bubble's input-gradient pass detaches it in place, which a view
    (the cnn's Flatten) refuses. The copy saves nothing for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone(memory_format=torch.contiguous_format)


class RunChunk(nn.Module):
    """Chunk c as the strategy runs it (``run_chunk``: under strategy.precision=bf16 on a bf16 copy
    of its fp32 weights with bf16 inputs, the last chunk's logits in fp32, as the manual loop and
    Megatron's bf16 run), so torch's stage sends bf16 activations and gradients; the chunk is its
    submodule, so the stage's parameters are its fp32 weights, whose .grad the casts' backward fills."""

    def __init__(self, pipe, c: int) -> None:
        super().__init__()
        self.chunk = pipe.chunks[c]
        self.__dict__["run"] = lambda x: pipe.run_chunk(c, x)  # not a submodule: the strategy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def torch_schedule(pipe, loss_fn):
    """The schedule object for ``pipe``'s chunks (``pipe``: the strategy)."""
    from torch.distributed import pipelining

    o = pipe.opts
    n = o.stages * o.virtual_stages
    stages = []
    for c, (chunk, g) in enumerate(zip(pipe.chunks, pipe.chunk_ids)):
        chunk = RunChunk(pipe, c) if pipe.compute_dtype != torch.float32 else chunk
        module = nn.Sequential(chunk, OwnOutput()) if g < n - 1 else chunk
        stage = pipelining.PipelineStage(module, g, n, pipe.device, group=pipe.group)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, pipe.busy.timed(getattr(stage, name)))
        stages.append(stage)
    cls = getattr(pipelining, TORCH_SCHEDULES[str(o.schedule)])
    # scale_grads=False: torch would divide ALL accumulated gradients by m after each step,
    # which breaks gradient accumulation; our loss is pre-scaled instead (pp/strategy.py).
    given = stages if str(o.schedule) in MULTI else stages[0]
    return cls(given, n_microbatches=o.microbatches, loss_fn=loss_fn, scale_grads=False), stages


@contextlib.contextmanager
def torch_waits_traced_as_idle():
    """torch.distributed.pipelining blocks on its stage-to-stage messages in one module function,
    ``schedules._wait_batch_p2p``; wrapped here so the trace labels those waits idle (the bubble),
    as the manual loop's ``recv`` does, instead of exposed communication. Only while this
    strategy's step runs; a torch without that function is left as it is (the waits then count
    as communication)."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        yield
        return

    def wait(work):
        with trace_label(f"{IDLE_LABEL}p2p"):
            return original(work)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original
