"""``pp``'s options (``PPOptions``) and parent-side rules (``PPPlan``): the options it refuses, the
(replicate, pp) mesh it lays out, and what the planner predicts of each rank (the cut is
``plan.py``'s, the same setup makes; the schedule's order is ``schedules.py``'s, the same the
manual loop runs). Torch-free at import (the parent reads it before any process starts,
strategies/planning.py): what needs the model (the cut, the shapes) imports torch inside."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Choice, Precision, make_choice
from parallel_lab.errors import ConfigError
from parallel_lab.strategies.cp.rules import ContextOptions, add_comm, cp_of
from parallel_lab.strategies.mesh import MeshDims, check_degrees
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import ClusterLayout, ComputeShape, PlanRules, SavedBytes
from parallel_lab.strategies.pp.checks import check_balance, check_pp_tp
from parallel_lab.strategies.pp.chunks import (
    _refs,
    _split_bytes,
    chunk_inputs,
    chunk_modules,
    chunk_names,
    chunk_shares,
    held_chunks,
    in_embedding_group,
    meta_model,  # noqa: F401  (re-exported: strategy.py, ds_pipe.py)
    pp_dims,
    rank_module,
    stage_of,
)
from parallel_lab.strategies.pp.cp_rules import (
    check_pp_cp,
    cp_boundary,
    cp_flop_fraction,
    cp_meta_chunk,
    stage_context_comm,
)
from parallel_lab.strategies.pp.cuts import check_cut, config_blocks
from parallel_lab.strategies.pp.model_rules import check_bf16
from parallel_lab.strategies.pp.schedules import INTERLEAVED, SCHEDULES, peak_in_flight, rank_orders
from parallel_lab.strategies.pp.zb_orders import run_orders
from parallel_lab.strategies.registry import register_rules

if TYPE_CHECKING:
    from torch import nn

# What each strategy.impl runs (PipelineImpl); a pair (schedules, balances) per impl.
BALANCES = ("params", "flops", "time")
IMPLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "manual": (("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"), BALANCES),
    "torch": (("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"), BALANCES),
    # deepspeed.pipe's engine runs its own TrainSchedule, a 1F1B order, on the cut plan_stages makes
    "deepspeed": (("1f1b",), BALANCES),
}


class PipelineImpl(Choice):
    """strategy.impl of pp: whose pipeline runs the stages (IMPLS: what each runs)."""

    manual = "manual"
    torch = "torch"
    deepspeed = "deepspeed"  # DeepSpeed's PipelineEngine (pp/ds_pipe.py)


Schedule = make_choice("Schedule", SCHEDULES, "strategy.schedule of pp: the micro-batch order.", __name__)
Balance = make_choice("Balance", BALANCES, "strategy.balance of pp: what the cut evens out.", __name__)


@dataclass
class PPOptions(ContextOptions, StrategyOptions):
    """``strategy=pp`` options (``strategy.cp``/``cp_impl``: context parallelism in each stage, pp/cp.py)."""

    stages: int = 2  # pipeline stages, one per process; replicate x stages = world_size
    replicate: int = 1  # data-parallel copies of the pipeline (dp x pp on a 2-D mesh); 1 = one pipeline
    microbatches: int = 4  # micro-batches per train step; must divide trainer.global_batch / trainer.grad_accum
    # gpipe | 1f1b | interleaved_1f1b | zero_bubble (ZB-H1, arXiv 2401.10241: backward split into
    # input- and weight-gradient passes, the latter filling the bubble; impl=manual one chunk per
    # rank, impl=torch its interleaved ScheduleInterleavedZeroBubble)
    schedule: Schedule = Schedule["gpipe"]
    # manual (our send/recv loop) | torch (torch.distributed.pipelining) | deepspeed (deepspeed.pipe, 1f1b only)
    impl: PipelineImpl = PipelineImpl.manual
    # model chunks per rank (interleaved schedules): the model is cut into stages x virtual_stages chunks
    virtual_stages: int = 1
    # what the cut evens out per chunk: flops (forward FLOPs, models/flops.py) | params | time (measured)
    balance: Balance = Balance["flops"]
    # balance=time: each block's forward+backward seconds, measured in the parent when left [] (pp/timing.py)
    block_times: list[float] = field(default_factory=list)
    # balance=time, zero_bubble, manual: each block's [F, B, W] seconds, measured with block_times when
    # both are left []; zero bubble's order is built from them per stage (pp/zb_orders.py)
    pass_times: list[list[float]] = field(default_factory=list)
    # names of the blocks that start chunks 2..p*v, e.g. [fc1]; [] = cut by strategy.balance
    cuts: list[str] = field(default_factory=list)
    # tensor-parallel degree inside each stage (vit, impl=manual: Megatron's split of its blocks,
    # pp/tensor.py); replicate x stages x tp = world_size
    tp: int = 1
    # tp > 1 (arXiv 2205.05198): the token regions and the p2p activations hold tokens/tp per rank
    sequence_parallel: bool = False
    # fp32 | bf16 (impl=manual|torch): as Megatron trains, each chunk computes on a bf16 copy of the stage's
    # fp32 weights (its tp shards), so the activations and gradients sent between stages and over tp
    # are bf16; fp32 weights, gradients and Adam state (strategies/precision.py)
    precision: Precision = Precision.fp32


def check_schedule(opts: DictConfig, cfg: DictConfig) -> None:
    """The schedule, balance and virtual stages this impl runs; one line naming the fix."""
    if str(opts.impl) == "deepspeed" and str(opts.schedule) == "gpipe":
        # The default schedule, which DeepSpeed's engine cannot run: its TrainSchedule is 1F1B, and
        # the resolved config.yaml says so (as balance=time's measured block_times are written there).
        opts.schedule = "1f1b"
    impl, schedule, v = str(opts.impl), str(opts.schedule), opts.virtual_stages
    schedules, balances = IMPLS.get(impl, ((), ()))
    if schedule not in schedules:
        have = [i for i, (s, _) in IMPLS.items() if schedule in s]
        fix = f"use strategy.impl={have[0]}" if have else f"choose strategy.schedule={'|'.join(schedules)}"
        raise ConfigError(f"strategy.schedule={schedule} is not one strategy.impl={impl} runs; {fix}")
    if str(opts.balance) not in balances:
        raise ConfigError(
            f"strategy.balance={opts.balance} is not one strategy.impl={impl} cuts by; use strategy.balance="
            f"{'|'.join(balances)}"
        )
    if v > 1 and schedule not in INTERLEAVED:
        raise ConfigError(
            f"strategy.virtual_stages={v} needs an interleaved schedule (each rank several chunks); use "
            f"strategy.schedule=interleaved_1f1b or strategy.virtual_stages=1"
        )
    p, m = opts.stages, opts.microbatches
    zb_h1 = impl == "manual" and schedule == "zero_bubble"
    if zb_h1 and v > 1:
        raise ConfigError(
            f"strategy.virtual_stages={v} with strategy.schedule=zero_bubble strategy.impl=manual: the manual "
            "loop runs ZB-H1, one chunk per rank; use strategy.virtual_stages=1 or strategy.impl=torch"
        )
    if zb_h1 and cfg.trainer.get("recompute", "none") != "none":
        raise ConfigError(
            f"trainer.recompute={cfg.trainer.recompute} with strategy.schedule=zero_bubble strategy.impl=manual: "
            "the deferred weight gradients keep layer inputs a recomputed region would drop; use trainer.recompute=none"
        )
    if schedule in INTERLEAVED and p > 1 and m % p and not zb_h1:
        raise ConfigError(
            f"strategy.microbatches={m} is not a multiple of strategy.stages={p}: interleaved 1F1B sends p "
            "micro-batches through a chunk before the next (arXiv 2104.04473); use "
            f"strategy.microbatches={p * max(1, m // p)}"
        )
    dropout = cfg.model.get("dropout") or 0
    if impl == "torch" and dropout > 0:
        raise ConfigError(
            f"model.dropout={dropout} with strategy.impl=torch: torch's PipelineStage runs an extra forward "
            "of the first micro-batch to infer shapes, which draws that micro-batch's dropout keys twice; "
            "use strategy.impl=manual"
        )
    experts = cfg.model.get("moe_experts") or 0
    if impl != "manual" and experts:
        raise ConfigError(
            f"model.moe_experts={experts} with strategy.impl={impl}: its pipeline backpropagates the last stage's "
            "loss alone (earlier stages' load-balancing losses lost); use strategy.impl=manual, whose stages add theirs"
        )
    if impl == "torch" and schedule == "1f1b" and m < p:
        raise ConfigError(
            f"strategy.microbatches={m} < strategy.stages={p}: torch's Schedule1F1B "
            f"needs microbatches >= stages; raise strategy.microbatches or use strategy.impl=manual"
        )


@register_rules("pp")
class PPPlan(PlanRules):
    Options = PPOptions
    degree_key = "stages"
    ranks_differ = True  # each stage holds, stashes and sends its own part
    weight_copies = True  # strategy.precision=bf16: Bf16Compute on the stage's chunks

    @classmethod
    def cluster_layout(cls, cfg: DictConfig) -> ClusterLayout:
        """The schedule's micro-batches and chunks per rank (arXiv 2104.04473), each stage split
        over strategy.tp (sequence-parallel or not)."""
        opts = cfg.strategy
        schedule = str(opts.schedule)
        if opts.virtual_stages > 1 and schedule not in INTERLEAVED:  # only these run several chunks per rank
            schedule = INTERLEAVED[0]
        return ClusterLayout(
            dims=cls.dims(cfg),
            schedule=schedule,
            virtual_stages=opts.virtual_stages,
            microbatches=opts.microbatches * cfg.trainer.grad_accum,
            sequence_parallel=bool(opts.get("sequence_parallel", False)),
            overlapped=cls.overlapped_collectives(cfg),
        )

    @classmethod
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """A stage runs its micro-batches one after another: no collective can normalise them together."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch":
            return None
        return (
            "model.norm=syncbatch: strategy=pp runs a stage's micro-batches one after another, so no collective can "
            "normalise over them together; use model.norm=batch (statistics per micro-batch, docs/batchnorm.md)"
        )

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        return pp_dims(cfg.strategy)

    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        """Every stage (every tp rank of it) sees its pipeline's whole batch, only the ends use it
        (= strategy.replicate once the degrees check; the planner asks before setting them)."""
        return cfg.world_size // (cfg.strategy.stages * cfg.strategy.get("tp", 1) * cp_of(cfg))

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        for key in ("stages", "microbatches", "virtual_stages"):
            if opts[key] < 1:
                raise ConfigError(f"strategy.{key}={opts[key]} must be >= 1; e.g. strategy.{key}=2")
        check_schedule(opts, cfg)
        check_pp_tp(opts, cfg)
        check_pp_cp(opts, cfg)
        check_bf16(opts)
        keys = {"pp": ("stages", "pipeline stages, one per process")}
        if opts.get("tp", 1) > 1:
            keys = {"pp": ("stages", "pipeline stages"), "tp": ("tp", "tensor-parallel ranks per stage")}
        if opts.cp > 1:
            keys = {"cp": ("cp", "context-parallel ranks per stage"), "pp": ("stages", "pipeline stages")}
        check_degrees(cfg, pp_dims(opts), keys)
        t = cfg.trainer
        per_step = t.global_batch // t.grad_accum
        if t.global_batch % t.grad_accum == 0 and per_step % opts.microbatches:
            raise ConfigError(
                f"strategy.microbatches={opts.microbatches} does not divide the per-step micro-batch of {per_step} "
                f"samples (trainer.global_batch={t.global_batch} / trainer.grad_accum={t.grad_accum}); "
                f"use a divisor of {per_step}"
            )
        check_cut(config_blocks(cfg), opts.stages, list(opts.cuts), opts.virtual_stages)  # the cut exists
        check_balance(opts, cfg)
        if opts.impl == "deepspeed":
            from parallel_lab.strategies.pp.ds_rules import check_deepspeed_pipe

            check_deepspeed_pipe(opts, cfg)

    @classmethod
    def min_global_batch(cls, cfg: DictConfig) -> int:
        return cfg.strategy.microbatches * cfg.trainer.grad_accum

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """GPipe (1811.06965): m forward and m backward slots per stage, p - 1 of them idle at the
        ends; the slowest stage paces every slot (1f1b has the same count of slots, fewer in flight).
        Interleaved: v m + p - 1 slots of one chunk each, the slowest chunk pacing them (2104.04473).
        strategy.tp > 1: each chunk's split layers' share divided by tp (pp/tensor.py); strategy.cp > 1:
        its token-wise layers' and attention's by cp."""
        from parallel_lab.strategies.pp.tensor import tp_flop_fraction

        o, t = cfg.strategy, cfg.trainer
        p, m, v, tp = o.stages, o.microbatches, o.get("virtual_stages", 1), o.get("tp", 1)
        chunks = chunk_modules(cfg, model)
        shares = chunk_shares(cfg, model)
        if tp > 1:
            inputs = chunk_inputs(cfg, model, 1)
            shares = [s * tp_flop_fraction(c, tuple(inputs[g][1:]), tp) for g, (s, c) in enumerate(zip(shares, chunks))]
        if cp_of(cfg) > 1:  # a cp rank's T/cp tokens (pp/cp_rules.py)
            inputs = chunk_inputs(cfg, model, 1)
            shares = [s * cp_flop_fraction(cfg, c, tuple(x[1:])) for s, c, x in zip(shares, chunks, inputs)]
        names = chunk_names(cfg, model)
        times = f"; block times ms {', '.join(f'{1000 * t:.1f}' for t in o.block_times)}" if o.block_times else ""
        return ComputeShape(
            micro_batch=t.global_batch // t.grad_accum // m,
            slots=t.grad_accum * (v * m + p - 1),
            flop_share=max(shares),
            calls_per_collective=m * t.grad_accum,
            note=f"{o.balance} cut {' | '.join(','.join(c) for c in names)}; chunk FLOP shares "
            + ", ".join(f"{s:.2f}" for s in shares)
            + times,
        )

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """The most bytes the rank's schedule stashes at once (``peak_in_flight`` of its order: gpipe
        all m micro-batches, 1f1b at most p - s, interleaved its warm-up's worth per chunk); only
        the last chunk computes the loss. zero_bubble, manual: each chunk's B and what it leaves for W
        from ``split_bytes`` (exact); torch's: counted as interleaved 1F1B (an upper bound)."""
        from parallel_lab.strategies.pp.plan import rank_chunks
        from parallel_lab.strategies.pp.tensor import boundary_shape, split_meta_stage

        o = cfg.strategy
        p, m, v, stage = o.stages, o.microbatches, o.get("virtual_stages", 1), stage_of(cfg, rank)
        mb = max(1, micro // m)
        shapes, chunks = chunk_inputs(cfg, model, mb), held_chunks(cfg, model, stage)
        tp, sp = o.get("tp", 1), bool(o.get("sequence_parallel"))
        shapes = [cp_boundary(boundary_shape(s, g, tp, sp), g, cp_of(cfg)) for g, s in enumerate(shapes)]
        mine, n = rank_chunks(o, stage), len(chunks)
        # with cp: the chunk as the rank's cp coordinate shards it (pp/cp_rules.py)
        per_chunk = [
            saved(split_meta_stage(cfg, cp_meta_chunk(cfg, chunks[g], rank, g == 0, g == n - 1), rank), mb,
                  tuple(shapes[g][1:]), g == n - 1)
            for g in mine
        ]  # fmt: skip
        schedule = str(o.schedule)
        if schedule == "zero_bubble" and str(o.impl) == "manual":  # exact: B's peak and what waits for W, measured
            stage_chunks = [
                (split_meta_stage(cfg, chunks[g], rank), tuple(shapes[g][1:]), g == len(chunks) - 1) for g in mine
            ]
            split = [_split_bytes(_refs(chunk), mb, shape, last) for chunk, shape, last in stage_chunks]
            return peak_in_flight(run_orders(o)[stage], per_chunk, split), mb  # the order the loop runs
        if schedule == "zero_bubble":  # torch's: counted as interleaved 1F1B, an upper bound
            schedule = "interleaved_1f1b"
        return peak_in_flight(rank_orders(schedule, m, p, v)[stage], per_chunk), mb

    @classmethod
    def predict_buffer_bytes(cls, cfg: DictConfig, model: nn.Module, rank: int) -> int:
        """The stage's BatchNorm buffers only."""
        return sum(b.numel() * b.element_size() for b in rank_module(cfg, model, rank).buffers())

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
        """The rank's blocks (``plan_stages``, the same cut setup makes), held whole (with tp: as
        its tp rank splits them) with torch's optimizer state (Adam: two moments and a 4-byte step
        tensor per parameter)."""
        from parallel_lab.strategies.memory import predicted_optimizer_bytes
        from parallel_lab.strategies.pp.tensor import split_meta_stage

        numels = [p.numel() for p in split_meta_stage(cfg, rank_module(cfg, model, rank), rank).parameters()]
        return {
            "param_bytes": 4 * sum(numels),
            "grad_bytes": 4 * sum(numels),
            "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
        }

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        """Per step, every micro-batch's activation goes forward across each boundary after one of
        this rank's chunks and its gradient back across the one before it: isend of the whole
        step's batch (SP: its tokens). With tp, the stage's Megatron collectives (``pp/tensor.py``)."""
        from parallel_lab.strategies.pp.plan import rank_chunks
        from parallel_lab.strategies.pp.tensor import boundary_shape, split_meta_stage, stage_tp_comm

        o = cfg.strategy
        replicate, tp, sp = o.get("replicate") or 1, o.get("tp", 1), bool(o.get("sequence_parallel"))
        batch = cfg.trainer.global_batch // cfg.trainer.grad_accum // replicate
        shapes = chunk_inputs(cfg, model, batch)  # chunk g's input; the last: the output
        sizes = [cp_boundary(boundary_shape(s, g, tp, sp), g, cp_of(cfg)).numel() for g, s in enumerate(shapes)]
        last = len(sizes) - 2
        mine = rank_chunks(o, stage_of(cfg, rank))
        sent = sum((sizes[g + 1] if g < last else 0) + (sizes[g] if g > 0 else 0) for g in mine)
        elem = 2.0 if o.get("precision") == "bf16" else 4.0  # bf16: activations and their gradients
        comm = {"isend": elem * sent * cfg.trainer.grad_accum} if sent else {}
        stage = split_meta_stage(cfg, rank_module(cfg, model, rank), rank)
        if tp > 1:
            for op, n in stage_tp_comm(cfg, stage, shapes[1], cfg.trainer.grad_accum).items():
                comm[op] = comm.get(op, 0.0) + n
        comm = add_comm(comm, stage_context_comm(cfg, stage, stage_of(cfg, rank) == o.stages - 1))  # pp/cp_rules.py
        if in_embedding_group(cfg, stage_of(cfg, rank)):  # the tied embedding's gradient, summed (pp/tied.py)
            tied = model.get_submodule("embed.tokens").weight.numel()
            comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 4 * tied
        ds = o.get("impl") == "deepspeed"
        # dp x pp: the stage's gradients (its shards) all-reduced over replicas. DeepSpeed's engine also
        # calls it on a one-rank data-parallel group: counted as called though nothing moves (the
        # counter counts what the library calls, as zero/predict.py counts DeepSpeed's one-rank groups)
        if replicate > 1 or ds:
            comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 4 * sum(q.numel() for q in stage.parameters())
        if ds and o.stages > 1:  # its loss pair (fp32) broadcast from the last stage, averaged there first
            comm["broadcast"], last = 8.0, stage_of(cfg, rank) == o.stages - 1
            comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 4 * (replicate > 1 and last)
        if cfg.trainer.grad_clip > 0:  # the norm's float64 square sum: over the pipeline (and the tp group)
            comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 8 * (1 + (tp > 1))
        return comm
