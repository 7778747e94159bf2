"""One training step on the cluster, split the way the issue asks: compute, exposed tensor-parallel
communication, the pipeline bubble (and its sends), exposed data-parallel/ZeRO/FSDP communication,
and the optimizer; per-GPU memory beside it.

- compute: the blocks of the slowest stage per micro-batch (the last: it also computes the logits;
  layers that do not divide leave the ends short, as Llama 3 does), each operator timed by its shape
  (``compute.py``), recomputation included;
- tensor parallelism (Megatron, arXiv 1909.08053): two all-reduces of the (b, s, h) activation per
  block in forward, two in backward, two more in a fully recomputed forward; with sequence
  parallelism each becomes an all-gather plus a reduce-scatter of the same bytes (arXiv
  2205.05198). Megatron issues them in line: exposed;
- context parallelism (``context.py``): each rank runs the block on its s/cp tokens; the ring's
  K/V hops hide behind the attention core they feed, Ulysses' all-to-alls are exposed;
- pipeline (arXiv 2104.04473): the bubble is (p - 1)/v of one micro-batch's stage time, and each
  micro-batch sends its activation forward and its gradient back at every chunk boundary;
- data parallelism: the gradients' all-reduce (ZeRO-1/2: reduce-scatter then all-gather, the same
  ring volume), ZeRO-3/FSDP's per-micro-batch parameter all-gathers (forward, backward, and again
  for a fully recomputed forward where ZeRO-3's hooks released them) and gradient reduce-scatter.
  What the strategy overlaps (``overlapped_collectives``) hides behind the pass it runs under (the
  forward's gather behind the forward, the rest behind backward); the rest is exposed;
- optimizer: Adam reads and writes about 30 bytes per local parameter at HBM speed.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from parallel_lab.plan.cluster import comm, context, memory, prefetch
from parallel_lab.plan.cluster.compute import DTYPE_BYTES, PassTime, block_pass, logits_pass
from parallel_lab.plan.cluster.hardware import Hardware
from parallel_lab.plan.cluster.shape import ModelShape
from parallel_lab.strategies.planning import ClusterLayout

ADAM_BYTES_PER_PARAM = 30.0  # read w, g, master, m, v; write w, master, m, v (16-bit w and g)
GRAD_OVERLAP = {"all_reduce", "reduce_scatter"}


@dataclass(frozen=True)
class ClusterRun:
    """Everything one prediction needs: the model, the machine, the layout and the training settings."""

    shape: ModelShape
    hw: Hardware
    layout: ClusterLayout
    global_batch: int
    precision: str = "bf16"
    recompute: str = "none"
    optimizer: str = "adam"
    cp_impl: str = "ring"  # strategy.cp_impl where the layout has cp > 1: ring | ulysses

    @property
    def gpus(self) -> int:
        return self.layout.dims.world

    @property
    def dp(self) -> int:
        return self.layout.dims.data_parallel_size

    @property
    def micro_batch(self) -> int:
        return max(1, self.global_batch // (self.dp * self.layout.microbatches))

    @property
    def grad_ranks(self) -> int:
        """The ranks that average each gradient: the data-parallel ones and, reading the same
        samples, the cp ranks (each held its own tokens)."""
        return self.dp * self.layout.dims.cp

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank: the micro-batch's sequences, s/cp of each."""
        return self.micro_batch * self.shape.seq // self.layout.dims.cp


@dataclass(frozen=True)
class ClusterPrediction:
    """Seconds per step by part, bytes per GPU by part, and the rates they give."""

    compute_s: float
    tp_comm_s: float
    bubble_s: float
    pp_p2p_s: float
    dp_comm_s: float
    optimizer_s: float
    memory: dict
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    micro_batch: int
    cp_comm_s: float = 0.0  # of tp_comm_s: the context-parallel part (the ring's or Ulysses')

    @property
    def memory_bytes_per_gpu(self) -> int:
        return int(sum(self.memory.values()))

    def to_json(self) -> dict:
        return {**asdict(self), "memory_bytes_per_gpu": self.memory_bytes_per_gpu}


def _tp_block_s(run: ClusterRun, tokens: int) -> float:
    dims, hw = run.layout.dims, run.hw
    payload = tokens * run.shape.hidden * DTYPE_BYTES[run.precision]
    calls = 4 + (2 if run.recompute == "full" else 0)
    return calls * comm.all_reduce_s(hw, payload, dims.tp, 1)


def stage_blocks(layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage. Layers that do not divide over the stages leave the ends short,
    the last stage (it computes the logits) first, then the first (it holds the embedding): Llama
    3's layout (arXiv 2407.21783 section 3.3.2: one layer fewer on the first and the last stage)."""
    big = -(-layers // pp)
    blocks = [big] * pp
    for i in range(pp * big - layers):
        end = pp - 1 - i // 2 if i % 2 == 0 else i // 2
        blocks[end] -= 1
    return blocks


@functools.lru_cache(maxsize=4096)
def block_time(
    shape: ModelShape,
    micro_batch: int,
    hw: Hardware,
    dtype: str,
    tp: int,
    tokens: int,
    sp: bool,
    recompute: str,
    cp: int = 1,
    cp_impl: str = "ring",
) -> PassTime:
    """compute.block_pass of the census's block on one cp rank (``tokens``: its own; memoised: a
    pure function of its arguments, and the recommender prices the same block at the same degrees
    for many layouts, ~5x fewer passes at 1,024 GPUs)."""
    ops = context.block_ops_on_rank(shape, micro_batch, cp, cp_impl)
    return block_pass(
        ops, hw, dtype, tp, tokens, sp, context.block_recompute(recompute, cp, cp_impl, shape.fused_attention)
    )


def _cp_block_s(run: ClusterRun) -> float:
    """Exposed context-parallel seconds of one block and micro-batch (context.py)."""
    lay = run.layout
    return context.exposed_block_s(
        run.hw, run.shape, run.micro_batch, lay.dims, run.cp_impl, run.precision, run.recompute, lay.sequence_parallel
    )


def _stage_pass(run: ClusterRun, tokens: int) -> tuple[PassTime, float, float]:
    """(the slowest stage's compute for one micro-batch, its exposed tensor- and context-parallel
    communication, the context-parallel part of it): the last stage's blocks and the logits, or a
    stage holding more blocks."""
    dims, lay = run.layout.dims, run.layout
    one = block_time(
        run.shape, run.micro_batch, run.hw, run.precision, dims.tp, tokens, lay.sequence_parallel, run.recompute,
        dims.cp, run.cp_impl,
    )  # fmt: skip
    cp_one = _cp_block_s(run)
    tp_one = _tp_block_s(run, tokens) + cp_one
    logits = logits_pass(tokens, run.shape.hidden, run.shape.vocab, dims.tp, run.hw, run.precision)
    counts = stage_blocks(run.shape.layers, dims.pp)

    def stage(blocks: int, head: float) -> PassTime:
        return PassTime(
            one.forward_s * blocks + head / 3, one.backward_s * blocks + 2 * head / 3, one.recompute_s * blocks
        )

    last, inner = (counts[-1], logits), (max(counts), 0.0)
    blocks, head = max(last, inner, key=lambda c: stage(*c).total_s + c[0] * tp_one)
    return stage(blocks, head), blocks * tp_one, blocks * cp_one


def _dp_comm(run: ClusterRun, stage: PassTime) -> float:
    """Exposed data-parallel seconds per step: what the strategy does not overlap, and what its
    overlap cannot hide behind the backward (ZeRO-3/FSDP: behind each micro-batch's pass)."""
    lay, dims, hw = run.layout, run.layout.dims, run.hw
    if run.grad_ranks == 1:
        return 0.0
    params = memory.params_on_rank(run.shape, dims.tp, dims.pp, first=True)
    width = DTYPE_BYTES[run.precision]
    stride, ways = dims.tp * dims.pp, max(1, lay.shard_ways)  # cp lies inside the data-parallel dims
    replicas = run.grad_ranks // ways
    grads = params * width
    if lay.shard_stage >= 3 and lay.regathers_on_recompute and "all_gather" in lay.overlapped:
        # DeepSpeed's ZeRO-3: one sub-module's gather ahead of its compute (prefetch.py)
        ops = context.block_ops_on_rank(run.shape, run.micro_batch, dims.cp, run.cp_impl)
        blocks = max(stage_blocks(run.shape.layers, dims.pp))
        return lay.microbatches * prefetch.exposed_s(run, ops, run.tokens, blocks, params)
    if lay.shard_stage >= 3:
        # Each pass gathers the parameters (forward; backward, and again for a fully recomputed
        # forward where the strategy released them) and reduce-scatters the gradients: the
        # forward's gather can hide only behind the forward, the rest behind backward.
        gather = comm.all_gather_s(hw, grads, ways, stride)
        regather = lay.regathers_on_recompute and run.recompute == "full"
        back = (2 if regather else 1) * gather + comm.reduce_scatter_s(hw, grads, ways, stride)
        back += comm.all_reduce_s(hw, grads / ways, replicas, stride * ways)
        if "all_gather" not in lay.overlapped:
            return lay.microbatches * (gather + back)
        exposed = max(0.0, gather - stage.forward_s) + max(0.0, back - stage.backward_s - stage.recompute_s)
        return lay.microbatches * exposed
    if lay.shard_stage >= 1:
        total = comm.reduce_scatter_s(hw, grads, ways, stride) + comm.all_gather_s(hw, grads, ways, stride)
        total += comm.all_reduce_s(hw, grads / ways, replicas, stride * ways)
    else:
        total = comm.all_reduce_s(hw, grads, run.grad_ranks, stride)
    hidden = stage.backward_s + stage.recompute_s if GRAD_OVERLAP & lay.overlapped else 0.0
    return max(0.0, total - hidden)


def _pipeline(run: ClusterRun, per_micro: float, tokens: int) -> tuple[float, float]:
    """(bubble seconds, exposed send seconds) of the schedule."""
    dims, lay = run.layout.dims, run.layout
    if dims.pp == 1:
        return 0.0, 0.0
    virtual = lay.virtual_stages if lay.schedule and "interleaved" in lay.schedule else 1
    bubble = (dims.pp - 1) / virtual * per_micro
    payload = tokens * run.shape.hidden * DTYPE_BYTES[run.precision] / dims.tp  # scatter/gather over tp
    sends = 2 * virtual * lay.microbatches * comm.send_s(run.hw, payload, dims.tp)
    return bubble, sends


def predict(run: ClusterRun) -> ClusterPrediction:
    """The step's parts, memory and rates of ``run``."""
    lay, dims = run.layout, run.layout.dims
    tokens = run.tokens
    stage, tp_s, cp_s = _stage_pass(run, tokens)
    compute = lay.microbatches * stage.total_s
    tp_comm = lay.microbatches * tp_s
    bubble, sends = _pipeline(run, stage.total_s + tp_s, tokens)
    dp = _dp_comm(run, stage)
    local = memory.params_on_rank(run.shape, dims.tp, dims.pp, first=True)
    local //= max(1, lay.shard_ways) if lay.shard_stage >= 1 else 1
    optimizer = local * ADAM_BYTES_PER_PARAM / (run.hw.hbm_gb_per_s * 1e9 * run.hw.memory_efficiency)
    step = compute + tp_comm + bubble + sends + dp + optimizer
    step_tokens = run.global_batch * run.shape.seq
    peak = run.hw.peak_flops(run.precision)
    hardware_flops = run.shape.flops_per_token(run.recompute) * step_tokens / (step * run.gpus)
    model_flops = run.shape.flops_per_token("none") * step_tokens / (step * run.gpus)
    return ClusterPrediction(
        compute_s=compute,
        tp_comm_s=tp_comm,
        bubble_s=bubble,
        pp_p2p_s=sends,
        dp_comm_s=dp,
        optimizer_s=optimizer,
        memory=memory_parts(run),
        step_time_s=step,
        tokens_per_s_per_gpu=step_tokens / (step * run.gpus),
        tflops_per_gpu=hardware_flops / 1e12,
        mfu=model_flops / peak,
        micro_batch=run.micro_batch,
        cp_comm_s=lay.microbatches * cp_s,
    )


def activation_bytes(run: ClusterRun, blocks: int) -> float:
    """What ``blocks`` blocks keep for backward per micro-batch on one rank."""
    lay, dims, shape = run.layout, run.layout.dims, run.shape
    if run.recompute == "selective_op":
        ops = context.block_ops_on_rank(shape, run.micro_batch, dims.cp, run.cp_impl)
        width = DTYPE_BYTES[run.precision]
        one = memory.op_policy_bytes(ops, dims.tp, run.tokens, shape.hidden, lay.sequence_parallel, width)
    else:
        one = memory.layer_activation_bytes(
            shape, run.micro_batch, dims.tp, lay.sequence_parallel, run.recompute, shape.fused_attention,
            dims.cp, run.cp_impl,
        )  # fmt: skip
    return blocks * one


def memory_parts(run: ClusterRun) -> dict[str, int]:
    """Bytes on the GPU holding the most (the first stage, or the last with its logits), and the
    allocator's reserve over them."""
    lay, dims, shape = run.layout, run.layout.dims, run.shape
    kind = memory.state_bytes(run.precision, run.optimizer)
    counts = stage_blocks(shape.layers, dims.pp)
    flight = memory.in_flight(lay.schedule, dims.pp, lay.microbatches, lay.virtual_stages)
    logits = memory.logits_bytes(shape, run.micro_batch, dims.tp, dims.cp)
    first = activation_bytes(run, counts[0]) * flight
    last = activation_bytes(run, counts[-1]) + logits
    activations = max(first + (logits if dims.pp == 1 else 0), last)
    state = memory.model_state(
        memory.params_on_rank(shape, dims.tp, dims.pp, True), kind, lay.shard_stage, lay.shard_ways
    )
    gathered = 0
    if lay.shard_stage >= 3:  # the unit being computed and the one prefetched, whole; at the loss
        # the output layer too (with the embedding: FSDP's root unit holds both, torchtitan's wrapping)
        ends = shape.embedding_params() if dims.pp == 1 else 0
        gathered = (2 * shape.layer_params() + ends) // dims.tp * kind.weights
    width = DTYPE_BYTES[run.precision]
    ring = context.ring_buffer_bytes(shape, run.micro_batch, dims.cp, dims.tp, width, run.cp_impl)
    parts = {
        **{f"model_state_{k}": v for k, v in state.items()},
        "activations": int(activations),
        "buffers": int(gathered + ring + run.hw.overhead_bytes),
    }
    return {**parts, "allocator_reserve": int(run.hw.allocator_slack * sum(parts.values()))}
