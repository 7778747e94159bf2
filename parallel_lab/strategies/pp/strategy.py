"""``pp``: toy pipeline parallelism. GPipe (Huang et al., arXiv 1811.06965), 1F1B (PipeDream,
Narayanan et al., arXiv 1806.03377), interleaved 1F1B (Narayanan et al., arXiv 2104.04473) and
zero bubble (Qi et al., arXiv 2401.10241). docs/pp.md.

The SAME model (an ``nn.Sequential`` of blocks) is cut into ``strategy.stages`` x
``strategy.virtual_stages`` contiguous chunks (``plan.py``, balanced by ``strategy.balance``):
rank s of a pipeline holds chunks s, s + p, ... and frees the other weights. Each step's batch is
split into ``strategy.microbatches`` micro-batches that flow through the chunks:

- forward: a chunk receives micro-batch i's activation from the chunk before it (recv), runs its
  blocks, sends the result on (send). The last chunk computes the loss.
- backward: the last chunk starts from the loss; every other receives d(loss)/d(its output),
  back-propagates through its blocks and sends d(loss)/d(its input) back.

Communication is point-to-point only. The price is the *bubble*: with p stages and m micro-batches
each stage idles (p-1)/(m+p-1) of a step under GPipe and 1F1B, (p-1)/(v m+p-1) interleaved
(``schedules.bubble_fraction``). Schedules (the order of one rank's forwards F and backwards B,
``schedules.py``): ``gpipe`` stashes all m micro-batches, ``1f1b`` at most p-s on stage s,
``interleaved_1f1b`` v chunks per rank, ``zero_bubble`` splits backward into input and weight
gradients and fills the bubble with the latter (manual: ZB-H1, ``pp/zero_bubble.py``; torch: its
interleaved class).

``strategy.impl=manual``: our isend/recv loop (``manual.py``); ``torch``: the same chunks as
torch's ``PipelineStage``s under its schedule classes (``torch_pipe.py``). Evaluation, the loss
report and the parameter gather are shared by both implementations.

dp x pp: ``strategy.replicate=R`` pipelines on a (replicate, pp) mesh (``strategies/mesh.py``),
R x stages = world_size. Pipeline r is ranks r*p .. r*p+p-1 and reads its own global_batch / R
samples; stage s averages its gradients with stage s of the other pipelines after backward.

dp x pp x tp: ``strategy.tp=T`` splits each stage's vit blocks (Megatron) over T consecutive ranks,
R x stages x T = world_size on a (replicate, pp, tp) mesh; a pipeline's ranks are then T apart
(``pp/tensor.py``, docs/meshes.md). dp x cp x pp: ``strategy.cp=C`` shards each stage's tokens over
its C cp ranks, a pipeline the ranks of one (replicate, cp) coordinate (``pp/cp.py``, docs/cp.md).

Gradient scaling: the loop calls ``train_step`` once per ``trainer.grad_accum`` chunk, and the
pipeline splits that chunk again into m micro-batches, so each micro-batch's mean loss is divided
by m * grad_accum before backward: the summed gradient is the gradient of the global-batch mean.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from parallel_lab.comm.counter import trace_label
from parallel_lab.models.moe import moe_layers
from parallel_lab.protocol import IDLE_LABEL
from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.batchnorm import ReplicaNorm
from parallel_lab.strategies.mesh import REPLICATE, Mesh, average_gradients
from parallel_lab.strategies.pp import handoffs
from parallel_lab.strategies.pp.activations import SavedTracker
from parallel_lab.strategies.pp.chunks import in_embedding_group, ties_across_stages
from parallel_lab.strategies.pp.cp import average_over_cp, context_stage, gathered_logits
from parallel_lab.strategies.pp.cp_rules import cp_boundary
from parallel_lab.strategies.pp.manual import ManualLoop
from parallel_lab.strategies.pp.plan import block_costs, rank_chunks
from parallel_lab.strategies.pp.rules import PPPlan, chunk_modules, chunk_names, meta_model
from parallel_lab.strategies.pp.schedules import Busy, bubble_fraction
from parallel_lab.strategies.pp.state import PPMemory, PPState
from parallel_lab.strategies.pp.tensor import (
    boundary_shape,
    clip_over_stages_and_tp,
    sum_sequence_parallel_grads,
)
from parallel_lab.strategies.pp.tied import EMBED, embedding_group, make_copy, sum_tied_gradients
from parallel_lab.strategies.pp.torch_pipe import torch_schedule, torch_waits_traced_as_idle
from parallel_lab.strategies.pp.zb_orders import stage_passes
from parallel_lab.strategies.precision import Bf16Compute, as_compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.tp.megatron import TPGroup, sequence_parallel_params
from parallel_lab.strategies.tp.split import split_transformer

SUBCLASSES: dict[str, type] = {}  # strategy.impl -> the subclass that runs it (filled by pp/ds_pipe.py)


@register("pp")
class PipelineParallelStrategy(Bf16Compute, Strategy):
    plan = PPPlan
    State = PPState
    Memory = PPMemory
    Norm = ReplicaNorm
    # dp x pp x tp (pp/tensor.py); these defaults: no split (strategy.tp=1, and impl=deepspeed's setup)
    tp_rank, tp_group, shard_dims, sp_params = 0, None, {}, []
    embedding_group = None  # a tied pipeline's first and last stage (pp/tied.py)
    cp_group = cp_pieces = None  # strategy.cp > 1: the stage's cp group, the gpt's pieces (pp/cp.py)

    def __new__(cls, cfg: DictConfig, env):
        """strategy.impl's own subclass where it has one (SUBCLASSES: deepspeed, pp/ds_pipe.py)."""
        return super().__new__(SUBCLASSES.get(cfg.strategy.impl, cls) if cls is PipelineParallelStrategy else cls)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.opts.stages - 1

    # ----- setup -----
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        coords = self.layout.coords(self.env.rank)
        self.stage, self.tp_rank = coords["pp"], coords["tp"]
        self.mesh = Mesh(self.layout, self.device.type, self.comm)  # collective
        self.group = self.mesh.group("pp")  # this rank's pipeline (None: the world)
        self.pipe_ranks = self.layout.group_ranks(self.env.rank, "pp")  # its global ranks, stage order
        self.tp_group = self.mesh.group("tp")  # this stage's tp ranks (None: tp = 1)
        self.replicate_group = self.mesh.group(REPLICATE)  # None: one pipeline
        meta = meta_model(self.cfg)
        self.chunk_names = chunk_names(self.cfg, meta)  # the planner's cut (balance, cuts), every chunk
        self.chunk_ids = rank_chunks(self.opts, self.stage)
        self.meta_chunks = chunk_modules(self.cfg, meta)
        children = dict(model.named_children())
        mine = [[(n, children[n]) for n in self.chunk_names[g]] for g in self.chunk_ids]
        if self.stage > 0 and in_embedding_group(self.cfg, self.stage):  # Megatron's copy, tied (pp/tied.py)
            mine[-1].insert(0, (EMBED, make_copy(children)))
        for name, child in children.items():
            if all(child is not c for chunk in mine for _, c in chunk):
                child.to("meta")  # free the weights of the other stages: this rank holds only its own
        self.model, self.chunks = self.build_stage(mine, self.group)
        if ties_across_stages(self.cfg):  # collective; None off the ends of the pipeline
            self.embedding_group = embedding_group(self)
        self.optimizer = make_optimizer(self.model.parameters())
        self.shapes: dict[tuple, torch.Size] = {}
        self.busy, self.recv_wait, self.send_time, self.losses, self.aux_losses = Busy(), 0.0, 0.0, [], []
        self.aux = model.aux if moe_layers(model) else None  # the MoE layers' load-balancing losses
        # per train_step: (total, busy, recv wait, isend calls) seconds
        self.records: list[tuple[float, float, float, float]] = []
        self.saved = SavedTracker(self.model.parameters())
        self.activation_peak = 0
        self.loop = ManualLoop(self) if self.opts.impl == "manual" else None
        self.schedule = torch_schedule(self, self._torch_loss)[0] if self.loop is None else None

    def build_stage(
        self, chunks: list[list[tuple[str, nn.Module]]], group
    ) -> tuple[nn.Sequential, list[nn.Sequential]]:
        """This rank's stage from its chunks' (name, module) pairs and its pipeline's group: the
        modules it holds in model order (same child names as the full model, so parameter names
        match the single run's) and each chunk as a Sequential of the same modules. The one place a
        stage is made: with strategy.tp > 1 its blocks are split over the stage's tp group
        (Megatron, tp/split.py; the pipeline's group is for the sends only)."""
        del group
        held = sorted((pair for chunk in chunks for pair in chunk), key=lambda pair: self.chunk_order(pair[0]))
        model = nn.Sequential(OrderedDict(held)).to(self.device)
        if self.opts.tp > 1:
            sp = self.opts.sequence_parallel
            self.shard_dims = split_transformer(model, TPGroup(self.tp_group, self.tp_rank, self.opts.tp), sp)
            params = dict(model.named_parameters())
            self.sp_params = [params[n] for n in sequence_parallel_params(model)] if sp else []
        context_stage(self, model)  # strategy.cp > 1: the stage's tokens sharded over its cp group (pp/cp.py)
        # the chunks from the (split) model's children: the SP split replaces the head itself
        return model, [nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n, _ in chunk)) for chunk in chunks]

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the chunks compute in and send: bf16 under strategy.precision=bf16 (Megatron's bf16)."""
        return torch.bfloat16 if self._bf16() else torch.float32

    def run_chunk(self, c: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk c on ``x``; bf16: on a bf16 copy of its fp32 weights (the cast is in the
        graph, so the gradients land in the fp32 weights' .grad) with bf16 inputs, logits in fp32."""
        chunk = self.chunks[c]
        if not self._bf16():
            return chunk(x)
        copies = {name: p.to(torch.bfloat16) for name, p in chunk.named_parameters()}
        out = torch.func.functional_call(chunk, copies, (as_compute(x, torch.bfloat16),))
        return out.float() if self.chunk_ids[c] == self.opts.stages * self.opts.virtual_stages - 1 else out

    def chunk_order(self, name: str) -> int:
        return [n for names in self.chunk_names for n in names].index(name)

    def chunk_input_shape(self, g: int, like: torch.Tensor) -> torch.Size:
        """Shape of global chunk g's input for a batch shaped like ``like`` (meta: no compute)."""
        key = (g, tuple(like.shape))
        if key not in self.shapes:
            x = torch.empty(like.shape, dtype=like.dtype, device="meta")  # token ids stay int64
            with torch.no_grad():
                for module in self.meta_chunks[:g]:
                    x = module(x)
            shape = boundary_shape(x.shape, g, self.opts.tp, self.opts.sequence_parallel)
            self.shapes[key] = cp_boundary(shape, g, self.layout.cp)  # cp: the rank's T/cp tokens
        return self.shapes[key]

    def rank_of(self, g: int) -> int:
        """The global rank holding chunk g in this rank's pipeline (with tp: the same tp coordinate)."""
        return self.pipe_ranks[g % self.opts.stages]

    # ----- training -----
    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        self.recv_wait, self.send_time, self.num_micro, self.losses, self.aux_losses = 0.0, 0.0, num_micro, [], []
        self.busy.seconds = 0.0
        self.saved.peak = held_before = self.saved.held
        start = time.perf_counter()
        with self.saved.hooks():
            if self.loop is not None:
                self.loop.step(inputs, targets, num_micro)
            else:
                self._torch_step(inputs, targets)
        if self.opts.stages > 1:
            # The flush: the pipeline's step ends when its last op anywhere is done; every stage
            # waits for it here (as before any optimizer step), so each stage's step is the
            # pipeline's and its idle the schedule's bubble, wherever in the step it falls.
            with trace_label(f"{IDLE_LABEL}flush"):
                dist.barrier(group=self.group)
        if self.loop is not None:
            self.loop.timeline.current["end"] = time.perf_counter()
        self.records.append((time.perf_counter() - start, self.busy.seconds, self.recv_wait, self.send_time))
        self.activation_peak = self.saved.peak - held_before
        # Only the last stage has the loss; the others return their MoE chunks' load-balancing
        # losses (mean over the micro-batches) or 0: global_mean_loss sums the stages.
        local = torch.stack(self.losses).mean() if self.losses else torch.zeros((), device=self.device)
        if self.aux_losses:
            local = local + torch.stack(self.aux_losses).sum() / self.opts.microbatches
        return local

    def _torch_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Called by torch per micro-batch (and once on placeholder tensors while it infers shapes).
        return self.loss_fn(out, target) / (self.opts.microbatches * self.num_micro)

    def _torch_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        n = self.opts.stages * self.opts.virtual_stages
        first, last = 0 in self.chunk_ids, n - 1 in self.chunk_ids
        args = (inputs,) if first else ()
        kwargs = {"target": targets, "losses": []} if last else {}
        with torch_waits_traced_as_idle():
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if last:  # undo the pre-scaling to report each micro-batch's mean loss
            self.losses = [x.detach() * (self.opts.microbatches * self.num_micro) for x in kwargs["losses"]]

    def average_over_replicas(self) -> None:
        """Data parallelism: stage s averages its gradients with stage s of the other pipelines
        (with cp: first over the stage's cp group, then over the replicas: replicate x cp)."""
        average_over_cp(self)
        average_gradients(self.model.parameters(), self.replicate_group, self.opts.replicate)

    def optimizer_step(self) -> None:
        sum_sequence_parallel_grads(self)
        sum_tied_gradients(self)  # before the norm and the step: both copies hold single's gradient
        self.average_over_replicas()
        super().optimizer_step()

    def clip_gradients(self) -> None:
        """Clip by the norm of the whole model's gradient: every stage's squares are summed (and,
        with tp, every shard's; the replicated parameters counted once)."""
        if self.cfg.trainer.grad_clip > 0:
            clip_over_stages_and_tp(self, self.cfg.trainer.grad_clip)

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """Only the last stages have the loss (the others hold 0; of a split last stage, tp rank 0's
        counts): the sum over the world, divided by the number of pipelines (replicate x cp: a cp
        rank's is its tokens' share, pp/cp.py), so every rank returns the same float."""
        loss = local_mean.detach().clone().to(self.device)
        if self.tp_rank:
            loss.zero_()  # (not a product: a NaN loss stays NaN on tp rank 0 only)
        dist.all_reduce(loss)
        return float(loss / (self.opts.replicate * self.layout.cp))

    # ----- evaluation: one forward of the whole batch through the chunks, in model order -----
    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Logits on the rank of the last chunk, None elsewhere (every stage must call this together)."""
        n, x = self.opts.stages * self.opts.virtual_stages, inputs
        for c, g in enumerate(self.chunk_ids):
            if g > 0 and self.rank_of(g - 1) != self.env.rank:
                x = torch.empty(self.chunk_input_shape(g, inputs), dtype=self.compute_dtype, device=self.device)
                dist.recv(x, src=self.rank_of(g - 1), group=self.group)
            x = self.run_chunk(c, x)
            if g < n - 1 and self.rank_of(g + 1) != self.env.rank:
                dist.send(x.contiguous(), dst=self.rank_of(g + 1), group=self.group)
        return gathered_logits(self, x if n - 1 in self.chunk_ids else None)  # cp: the gpt's tokens gathered

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # only the last stages counted (each its pipeline's shard; a split stage's on every tp rank:
        # tp rank 0's kept); the rest hold 0; the cp ranks of a last stage scored the same samples
        if self.tp_rank:
            counts.zero_()
        dist.all_reduce(counts)
        return counts / self.layout.cp

    # ----- proof -----
    def extra_metrics(self) -> dict:
        o = self.opts
        p, m, v = o.stages, o.microbatches, o.virtual_stages
        skip = self.cfg.trainer.warmup_steps * self.cfg.trainer.grad_accum
        kept = self.records[skip:] if len(self.records) > skip else self.records
        total, busy, wait, send = (sum(r[i] for r in kept) for i in range(4))
        manual = self.loop is not None
        mine = {
            "idle_s": max(total - busy, 0.0),
            "busy_s": busy,
            "step_s": total,
            # the median step's: a step in which another process took this core is one outlier
            "idle_fractions": [max(t - b, 0.0) / t for t, b, *_ in kept],
            "recv_wait_s": wait if manual else None,
            "send_s": send if manual else None,
            "max_inflight": self.loop.max_inflight if self.loop is not None else None,
            # manual impl, the per-op records: their first handoffs.RECORDED_STEPS steps after warm-up
            "op_seconds": mean_op_seconds(self.loop.op_seconds.recorded()) if manual else None,
            "op_seconds_steps": [mean_op_seconds([s]) for s in self.loop.op_seconds.recorded()] if manual else None,
            "recvs_late": self.loop.late if manual else None,
            "timeline": self.loop.timeline.recorded() if manual else None,
            "host": socket.gethostname(),
            "params": sum(q.numel() for q in self.model.parameters()),
            "layers": [n for g in self.chunk_ids for n in self.chunk_names[g]],  # a tied copy not listed
            "activation_peak": self.activation_peak,
        }
        stages: list = [None] * self.env.world_size
        dist.all_gather_object(stages, mine)
        stages = [stages[r] for r in self.layout.group_ranks(0, "pp")]  # the first pipeline's; replicas mirror them
        one_clock = len({st["host"] for st in stages}) == 1  # the marks' clock is the host's
        handoff_costs = handoffs.costs_per_step([st["timeline"] for st in stages], one_clock) if manual else None
        return {
            "pp_stages": p,
            "pp_microbatches": m,
            "pp_virtual_stages": v,
            "pp_schedule": str(o.schedule),
            "pp_impl": str(o.impl),
            "pp_balance": str(o.balance),
            "pp_block_costs": block_costs(meta_model(self.cfg), str(o.balance), list(o.block_times)),
            "pp_block_times_s": list(o.block_times) or None,  # balance=time: measured in the parent
            # zero bubble with pass times: each stage's (F, B, W) its order was built from (pp/zb_orders.py)
            "pp_stage_passes_s": stage_passes(o),
            "pp_chunk_layers": self.chunk_names,
            "pp_stage_layers": [st["layers"] for st in stages],
            "pp_stage_params": [st["params"] for st in stages],
            # torch's zero bubble is not ZB-H1: interleaved 1F1B's bubble is its bound
            "pp_bubble_fraction_theory": bubble_fraction(
                str(o.schedule) if manual or str(o.schedule) != "zero_bubble" else "interleaved_1f1b", m, p, v
            ),
            # Measured over the steps after warm-up: step time minus time in this stage's compute.
            "pp_idle_s": [st["idle_s"] for st in stages],
            "pp_busy_s": [st["busy_s"] for st in stages],  # its timed forward/backward calls (and loss)
            "pp_step_s": [st["step_s"] for st in stages],  # its train_step calls, flush included
            "pp_idle_fraction": [statistics.median(st["idle_fractions"] or [0.0]) for st in stages],
            "pp_idle_fraction_steps": [st["idle_fractions"] for st in stages],  # each train_step after warm-up
            "pp_recv_wait_s": [st["recv_wait_s"] for st in stages],  # manual impl: time blocked in recv
            "pp_send_s": [st["send_s"] for st in stages],  # manual impl: time in isend calls (hand-offs)
            "pp_max_inflight_microbatches": [st["max_inflight"] for st in stages],  # manual impl
            "pp_op_seconds": [st["op_seconds"] for st in stages],
            # manual impl: the same per measured step (each step's replay beside its measured idle)
            "pp_op_seconds_steps": [st["op_seconds_steps"] for st in stages],
            # manual impl: receives posted only as their op began (none: all at the step's start, pp/manual.py)
            "pp_recvs_posted_late": [st["recvs_late"] for st in stages],
            # manual impl, per stage: what its hand-offs cost (pp/handoffs.py), the replay adds them
            "pp_handoff_steps": handoff_costs,
            **{f"pp_handoff_{k}": val for k, val in (handoffs.summary(handoff_costs) if manual else {}).items()},
            # bytes autograd held for backward at the step's peak (pp/activations.py), last step
            "pp_activation_peak_bytes": [st["activation_peak"] for st in stages],
        }

    def teardown(self) -> None:
        super().teardown()
        self.schedule = self.loop = self.meta_chunks = self.chunks = self.saved = self.replicate_group = None


def mean_op_seconds(steps: list[dict[tuple[str, int], list[float]]]) -> dict[str, float]:
    """Manual impl: the mean seconds of each op per global chunk over the steps after warm-up,
    "F3" -> s (schedules.replay_idle plays them). The mean, not the median: the ops' sum is the
    stage's busy time, which an op slowed by another process still adds to."""
    runs: dict[str, list[float]] = {}
    for step in steps:
        for (op, g), seconds in step.items():
            runs.setdefault(f"{op}{g}", []).extend(seconds)
    return {key: statistics.fmean(values) for key, values in runs.items()}
