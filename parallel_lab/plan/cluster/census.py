"""Every operator of one transformer block's forward and backward, counted on the meta device at
one micro-batch: the GEMMs with their M, K, N (and batch, for the attention's batched products),
every other operator with the bytes it reads and writes. Nothing is allocated.

The block is the real module's (``model=gpt``'s block where this checkout has it, else the vit's
``Block``, the same pre-LN attention + MLP); every block of the model is the same, so one is
counted and the planner multiplies. Under tensor parallelism each rank runs the same operators on
its shard (Megatron, arXiv 1909.08053): ``OpRecord.on_tp_rank`` divides what it splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch.utils.flop_counter import flop_registry

from parallel_lab.plan.census import _is_view, _tensors
from parallel_lab.plan.cluster.shape import ModelShape
from parallel_lab.plan.metamemo import PlanMode

_GEMMS = ("mm", "addmm")
# aten operators that move no bytes: a view its schema does not mark (matmul's reshape of a batched
# product's output) and allocations (the seed gradient backward starts from).
_NO_BYTES = ("_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty")
_BATCHED = ("bmm", "baddbmm")


@dataclass(frozen=True)
class OpRecord:
    """One operator call: a GEMM (m, k, n, batch) with its FLOPs, or memory traffic in bytes."""

    kind: str  # "gemm", "bmm", "attention" (a fused kernel, FLOPs only), "memory"
    phase: str  # "fwd" or "bwd"
    flops: float = 0.0
    bytes: float = 0.0
    m: int = 0
    k: int = 0
    n: int = 0
    batch: int = 1
    token_sized: bool = False  # a memory op over (tokens, hidden): replicated under plain tp, split under sp
    attention_core: bool = False  # scores, softmax, weighted sum: what selective recomputation repeats
    name: str = ""  # the aten operator (its overload packet): what a fusion rule matches
    causal_share: float = 0.0  # a fused kernel's FLOPs run in causal (masked) calls; the rest unmasked

    def on_tp_rank(self, tp: int, tokens: int, sequence_parallel: bool) -> OpRecord:
        """This op on one of tp ranks: a GEMM's split dimension (its largest one that is not the
        tokens) divided, a batched product's heads, memory traffic unless it is a token region
        that plain tp replicates."""
        if tp == 1:
            return self
        if self.kind == "gemm":
            dims = [self.m, self.k, self.n]
            split = max((i for i in range(3) if dims[i] != tokens), key=lambda i: dims[i], default=2)
            dims[split] = max(1, dims[split] // tp)
            return replace(self, m=dims[0], k=dims[1], n=dims[2], flops=self.flops / tp)
        if self.kind in ("bmm", "attention"):
            return replace(self, batch=max(1, self.batch // tp), flops=self.flops / tp, bytes=self.bytes / tp)
        if self.token_sized and not sequence_parallel:
            return self
        return replace(self, bytes=self.bytes / tp)


def _dims(name: str, args) -> tuple[int, int, int, int]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    a, b = tensors[-2], tensors[-1]
    if name in _BATCHED:
        return a.shape[-2], a.shape[-1], b.shape[-1], a.shape[0]
    return a.shape[0], a.shape[1], b.shape[1], 1


class _Recorder(PlanMode):
    def __init__(self, tokens: int, hidden: int, score_numel: int) -> None:
        super().__init__()
        self.phase, self.tokens, self.hidden, self.score_numel = "fwd", tokens, hidden, score_numel
        self.ops: list[OpRecord] = []

    def _residual(self, t: torch.Tensor) -> bool:
        """A tensor of the residual stream, (tokens, hidden): what plain tp replicates on every rank.
        A head-split tensor of the same size (q, the attention's output before its projection,
        rotary's products) has the head dimension last and is split over tp with its heads."""
        return t.numel() == self.tokens * self.hidden and t.shape[-1] == self.hidden

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.overloadpacket in flop_registry:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            if name in _GEMMS or name in _BATCHED:
                m, k, n, batch = _dims(name, args)
                kind = "gemm" if name in _GEMMS else "bmm"
                core = kind == "bmm"
                self.ops.append(OpRecord(kind, self.phase, flops, 0.0, m, k, n, batch, attention_core=core, name=name))
            else:  # a fused attention kernel (scaled_dot_product_*): its FLOPs, its heads as the batch
                q = next(t for t in _tensors(args))
                self.ops.append(
                    OpRecord("attention", self.phase, flops, batch=q.shape[0] * q.shape[1], attention_core=True)
                )
        elif not _is_view(func, args, out) and name not in _NO_BYTES:
            tensors = _tensors((args, kwargs, out))
            moved = float(sum(t.numel() * t.element_size() for t in tensors))
            outs = _tensors(out)
            numels = {t.numel() for t in outs}
            self.ops.append(
                OpRecord(
                    "memory",
                    self.phase,
                    bytes=moved,
                    token_sized=any(self._residual(t) for t in outs),
                    attention_core=self.score_numel in numels,
                    name=name,
                )
            )
        return out


def _block(shape: ModelShape) -> torch.nn.Module:
    """One block of the real model on meta: models/gpt.py's (the vit's for model=vit)."""
    from parallel_lab.models.recompute import Recompute

    with torch.device("meta"):
        if shape.family == "vit":
            from parallel_lab.models.vit import Block as ViTBlock

            return ViTBlock(shape.hidden, shape.heads, shape.ffn, torch.nn.Identity, Recompute())
        from parallel_lab.models.gpt import Block

        return Block(shape.gpt_sizes(), torch.nn.Identity, Recompute())


def fused(ops: tuple[OpRecord, ...], causal: bool) -> tuple[OpRecord, ...]:
    """The block as a fused attention kernel runs it (FlashAttention, Dao et al. arXiv 2205.14135):
    the attention core's products kept as one kernel's FLOPs per phase, its score-sized memory
    traffic (mask, softmax, their backward) gone: the scores never leave the chip. A causal
    kernel skips the masked half of the score blocks (gpt): half the products' FLOPs are run, all
    of them in causal calls (``causal_share`` 1: compute.attention_seconds prices them so)."""
    kept = [op for op in ops if not op.attention_core]
    for phase in ("fwd", "bwd"):
        core = [op for op in ops if op.attention_core and op.phase == phase and op.kind != "memory"]
        if core:
            flops = sum(op.flops for op in core) * (0.5 if causal else 1.0)
            first = core[0]
            dims = {"m": first.m, "k": first.k, "n": first.n, "batch": first.batch}
            share = 1.0 if causal else 0.0
            kept.append(OpRecord("attention", phase, flops, **dims, attention_core=True, causal_share=share))
    return tuple(kept)


@functools.lru_cache(maxsize=256)
def block_ops(shape: ModelShape, micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> tuple[OpRecord, ...]:
    """One block's forward and backward on ``micro_batch`` sequences, every operator (cached:
    the recommender asks for the same shapes many times)."""
    block = _block(shape).to(dtype)
    x = torch.empty(micro_batch, shape.seq, shape.hidden, device="meta", dtype=dtype, requires_grad=True)
    recorder = _Recorder(micro_batch * shape.seq, shape.hidden, micro_batch * shape.heads * shape.seq * shape.seq)
    with recorder:
        y = block(x)
        recorder.phase = "bwd"
        y.backward(torch.empty_like(y))
    ops = tuple(recorder.ops)
    return fused(ops, causal=shape.family == "gpt") if shape.fused_attention else ops
