"""``pp``: toy pipeline parallelism. GPipe (Huang et al., arXiv 1811.06965) and 1F1B (PipeDream,
Narayanan et al., arXiv 1806.03377).

The SAME model (an ``nn.Sequential`` of blocks) is cut into ``strategy.stages`` contiguous stages,
one per process: rank s keeps only stage s (the other stages' weights are freed). Each step's batch
is split into ``strategy.microbatches`` micro-batches that flow through the stages:

- forward: stage s receives micro-batch i's activation from s-1 (recv), runs its blocks, sends the
  result to s+1 (send). The last stage computes the loss.
- backward: the last stage starts from the loss; every other stage receives d(loss)/d(its output)
  from s+1, back-propagates through its blocks and sends d(loss)/d(its input) to s-1.

Communication is point-to-point only: per micro-batch, one activation and one gradient tensor per
stage boundary. The price is the *bubble*: with p stages and m micro-batches each stage idles for
(p-1) of the m+p-1 time slots of a step, a fraction (p-1)/(m+p-1), whatever the schedule.

Schedules (the order in which one stage runs its forwards F and backwards B):
- ``gpipe``: all m forwards, then all m backwards. Simple; every stage stashes m activations.
- ``1f1b``: a few warm-up forwards (p-s-1), then alternate one forward / one backward, then the
  remaining backwards. Same bubble, but stage s stashes at most p-s activations instead of m.

``strategy.impl=torch`` runs the same stages with torch.distributed.pipelining (``PipelineStage``,
``ScheduleGPipe``, ``Schedule1F1B``). Evaluation, the loss report and the parameter gather are
shared by both implementations.

dp x pp: ``strategy.replicate=R`` pipelines on a (replicate, pp) mesh (``strategies/mesh.py``),
R x stages = world_size. Pipeline r is ranks r*p .. r*p+p-1 and reads its own global_batch / R
samples; stage s averages its gradients with stage s of the other pipelines after backward.

Gradient scaling: the loop calls ``train_step`` once per ``trainer.grad_accum`` chunk, and the
pipeline splits that chunk again into m micro-batches, so each micro-batch's mean loss is divided
by m * grad_accum before backward: the summed gradient is the gradient of the global-batch mean.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from parallel_lab.choices import Choice, make_choice
from parallel_lab.comm.counter import trace_label
from parallel_lab.protocol import IDLE_LABEL
from parallel_lab.strategies.base import OptimizerFactory, Strategy, StrategyOptions
from parallel_lab.strategies.batchnorm import ReplicaNorm
from parallel_lab.strategies.clip import clip_by_global_norm
from parallel_lab.strategies.memory import HeldMemory, analytic_state_bytes
from parallel_lab.strategies.mesh import REPLICATE, Mesh, average_gradients
from parallel_lab.strategies.pp.plan import plan_stages
from parallel_lab.strategies.pp.rules import PPPlan, meta_model
from parallel_lab.strategies.pp.schedules import SCHEDULES, BusyTimer
from parallel_lab.strategies.rank_shards import RankShardState
from parallel_lab.strategies.registry import register


class PipelineImpl(Choice):
    """strategy.impl of pp: whose pipeline runs the stages."""

    manual = "manual"
    torch = "torch"
    deepspeed = "deepspeed"  # DeepSpeed's PipelineEngine (pp/ds_pipe.py)


Schedule = make_choice("Schedule", SCHEDULES, "strategy.schedule of pp: the micro-batch order.", __name__)

IMPLS: dict[str, type] = {}  # strategy.impl -> the subclass that runs it (filled by pp/ds_pipe.py)
BACKWARD_TAG = 1 << 20  # p2p tags: forward of micro-batch i uses tag i, its backward BACKWARD_TAG + i


@dataclass
class PPOptions(StrategyOptions):
    """``strategy=pp`` options."""

    stages: int = 2  # pipeline stages, one per process; replicate x stages = world_size
    replicate: int = 1  # data-parallel copies of the pipeline (dp x pp on a 2-D mesh); 1 = one pipeline
    microbatches: int = 4  # micro-batches per train step; must divide trainer.global_batch / trainer.grad_accum
    schedule: Schedule = Schedule["gpipe"]  # gpipe | 1f1b
    # manual (our send/recv loop) | torch (torch.distributed.pipelining) | deepspeed (deepspeed.pipe)
    impl: PipelineImpl = PipelineImpl.manual
    # names of the blocks that start stages 2..p, e.g. [fc1]; [] = balance the stages by parameter count
    cuts: list[str] = field(default_factory=list)


class PPState(RankShardState):
    """One file per stage; the stages' parameters gathered to every rank in model order."""

    def full_parameters(self) -> list[torch.Tensor]:
        """Every stage's parameters, gathered to every rank in model order (stage order = rank order)."""
        per_stage: list = [None] * self.env.world_size
        dist.all_gather_object(per_stage, [p.detach().cpu() for p in self.model.parameters()])
        return [p for stage in per_stage[: self.opts.stages] for p in stage]


class PPMemory(HeldMemory):  # the model here is this stage only
    def analytic(self, num_params: int) -> dict[str, int]:
        """Textbook: each rank holds its stage's weights, gradients and optimizer state only."""
        return analytic_state_bytes(sum(p.numel() for p in self.model.parameters()), self.cfg.trainer)


class PPNorm(ReplicaNorm):
    @classmethod
    def refusal(cls, cfg: DictConfig, single_process: bool) -> str | None:
        """A stage runs its micro-batches one after another: no collective can normalise them together."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch":
            return None
        return (
            "model.norm=syncbatch: strategy=pp runs a stage's micro-batches one after another, so no collective can "
            "normalise over them together; use model.norm=batch (statistics per micro-batch, docs/batchnorm.md)"
        )


@register("pp")
class PipelineParallelStrategy(Strategy):
    Options = PPOptions
    plan = PPPlan
    State = PPState
    Memory = PPMemory
    Norm = PPNorm

    def __new__(cls, cfg: DictConfig, env):
        """strategy.impl's own subclass where it has one (IMPLS: deepspeed, pp/ds_pipe.py)."""
        return super().__new__(IMPLS.get(cfg.strategy.impl, cls) if cls is PipelineParallelStrategy else cls)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.opts.stages - 1

    # ----- setup -----
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        p = self.opts.stages
        self.stage = self.layout.coords(self.env.rank)["pp"]
        self.mesh = Mesh(self.layout, self.device.type, self.comm)  # collective
        self.group = self.mesh.group("pp")  # this rank's pipeline (None: the world)
        self.replicate_group = self.mesh.group(REPLICATE)  # None: one pipeline
        self.stage_names = plan_stages(model, p, list(self.opts.cuts))
        mine = self.stage_names[self.stage]
        children = dict(model.named_children())
        for name, child in children.items():
            if name not in mine:
                child.to("meta")  # free the weights of the other stages: this rank holds only its own
        # Same child names as the full model, so parameter names match the single run's.
        self.model = nn.Sequential(OrderedDict((n, children[n]) for n in mine)).to(self.device)
        self.optimizer = make_optimizer(self.model.parameters())
        meta = meta_model(self.cfg)
        self.meta_stages = [
            nn.Sequential(OrderedDict((n, meta.get_submodule(n)) for n in names)) for names in self.stage_names
        ]
        self.shapes: dict[tuple, torch.Size] = {}
        self.timer = BusyTimer(self.model)
        self.records: list[tuple[float, float, float]] = []  # per train_step: (total, busy, recv wait)
        self.max_inflight = 0
        self.schedule = self._torch_schedule() if self.opts.impl == "torch" else None

    def _torch_schedule(self):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        self.pipe_stage = PipelineStage(self.model, self.stage, self.opts.stages, self.device, group=self.group)
        # scale_grads=False: torch would divide ALL accumulated gradients by m after each step,
        # which breaks gradient accumulation; our loss is pre-scaled instead (see module docstring).
        return classes[self.opts.schedule](
            self.pipe_stage, n_microbatches=self.opts.microbatches, loss_fn=self._torch_loss, scale_grads=False
        )

    def _boundary_shape(self, stage: int, sample_shape: torch.Size, batch: int) -> torch.Size:
        """Shape of stage `stage`'s output for a batch (inferred on the meta device: no compute)."""
        key = (stage, tuple(sample_shape), batch)
        if key not in self.shapes:
            x = torch.empty((batch, *sample_shape), device="meta")
            for module in self.meta_stages[: stage + 1]:
                x = module(x)
            self.shapes[key] = x.shape
        return self.shapes[key]

    # ----- point-to-point helpers (manual impl) -----
    def _recv(self, shape: torch.Size, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, device=self.device)
        start = time.perf_counter()
        # The stage cannot compute until its neighbour's tensor arrives: the trace counts this as
        # idle (the pipeline bubble), not as communication (worker/timeline.py).
        with trace_label(f"{IDLE_LABEL}recv"):
            dist.recv(buf, src=src, tag=tag, group=self.group)  # src: a global rank
        self._recv_wait += time.perf_counter() - start  # idle: waiting for the neighbour
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # Non-blocking: a stage never waits for its neighbour to take the data, so two stages
        # sending to each other at once (1F1B's steady state) cannot deadlock.
        self._pending.append((dist.isend(tensor.contiguous(), dst=dst, tag=tag, group=self.group), tensor))

    # ----- training -----
    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        self._recv_wait, self._num_micro, self._losses = 0.0, num_micro, []
        self.timer.busy, self.timer.enabled = 0.0, True
        start = time.perf_counter()
        if self.schedule is None:
            self._manual_step(inputs, targets)
        else:
            self._torch_step(inputs, targets)
        self.timer.enabled = False
        self.records.append((time.perf_counter() - start, self.timer.busy, self._recv_wait))
        # Only the last stage has the loss; the others return a placeholder (see global_mean_loss).
        return torch.stack(self._losses).mean() if self.is_last else torch.zeros((), device=self.device)

    def _manual_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        m, p, s = self.opts.microbatches, self.opts.stages, self.stage
        xs, ys = inputs.chunk(m), targets.chunk(m)
        self._pending, stash = [], {}
        for op, i in SCHEDULES[self.opts.schedule](m, p, s):
            if op == "F":
                stash[i] = self._forward(i, xs[i], ys[i])
                self.max_inflight = max(self.max_inflight, len(stash))
            else:
                self._backward(i, *stash.pop(i))
        # gloo completes a send when the neighbour has received it: waiting here is waiting for
        # the neighbour to get to its recv, idle like a recv (worker/timeline.py).
        with trace_label(f"{IDLE_LABEL}send"):
            for work, _ in self._pending:
                work.wait()
        self._pending = []

    def _forward(self, i: int, x: torch.Tensor, y: torch.Tensor):
        if not self.is_first:
            shape = self._boundary_shape(self.stage - 1, x.shape[1:], len(x))
            x = self._recv(shape, src=self.env.rank - 1, tag=i).requires_grad_()
        out = self.model(x)
        if self.is_last:
            loss = self.loss_fn(out, y)
            self._losses.append(loss.detach())
            return x, loss
        self._send(out.detach(), dst=self.env.rank + 1, tag=i)
        return x, out

    def _backward(self, i: int, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.is_last:
            # out is micro-batch i's mean loss: scale so the summed gradient is the global mean's.
            (out / (self.opts.microbatches * self._num_micro)).backward()
        else:
            grad = self._recv(out.shape, src=self.env.rank + 1, tag=BACKWARD_TAG + i)
            out.backward(grad)
        if not self.is_first:
            self._send(x.grad, dst=self.env.rank - 1, tag=BACKWARD_TAG + i)

    def _torch_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Called by torch per micro-batch (and once on placeholder tensors while it infers shapes).
        return self.loss_fn(out, target) / (self.opts.microbatches * self._num_micro)

    def _torch_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": targets, "losses": []} if self.is_last else {}
        with _torch_waits_traced_as_idle():
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.is_last:  # undo the pre-scaling to report each micro-batch's mean loss
            self._losses = [x.detach() * (self.opts.microbatches * self._num_micro) for x in kwargs["losses"]]

    def average_over_replicas(self) -> None:
        """Data parallelism: stage s averages its gradients with stage s of the other pipelines."""
        average_gradients(self.model.parameters(), self.replicate_group, self.opts.replicate)

    def optimizer_step(self) -> None:
        self.average_over_replicas()
        super().optimizer_step()

    def clip_gradients(self) -> None:
        """Clip by the norm of the whole model's gradient: every stage's squares are summed."""
        if self.cfg.trainer.grad_clip > 0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            clip_by_global_norm(grads, [], self.cfg.trainer.grad_clip, self.device, self.group)

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """Only the last stages have the loss (the others hold 0): the sum over the world, divided by
        the number of pipelines, so every rank returns the same float."""
        loss = local_mean.detach().clone().to(self.device)
        dist.all_reduce(loss)
        return float(loss / self.opts.replicate)

    # ----- evaluation: one forward of the whole batch through the stages -----
    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Logits on the last stage, None elsewhere (every stage must call this together)."""
        x = inputs
        if not self.is_first:
            shape = self._boundary_shape(self.stage - 1, inputs.shape[1:], len(inputs))
            x = torch.empty(shape, device=self.device)
            dist.recv(x, src=self.env.rank - 1, group=self.group)
        out = self.model(x)
        if self.is_last:
            return out
        dist.send(out.contiguous(), dst=self.env.rank + 1, group=self.group)
        return None

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts)  # only the last stages counted (each its pipeline's shard); the rest hold 0
        return counts

    # ----- proof -----
    def extra_metrics(self) -> dict:
        p, m = self.opts.stages, self.opts.microbatches
        skip = self.cfg.trainer.warmup_steps * self.cfg.trainer.grad_accum
        kept = self.records[skip:] if len(self.records) > skip else self.records
        total, busy, wait = (sum(r[i] for r in kept) for i in range(3))
        mine = {
            "idle_s": max(total - busy, 0.0),
            "idle_fraction": max(total - busy, 0.0) / total if total else 0.0,
            "recv_wait_s": wait if self.schedule is None else None,
            "max_inflight": self.max_inflight if self.schedule is None else None,
            "params": sum(q.numel() for q in self.model.parameters()),
        }
        stages: list = [None] * self.env.world_size
        dist.all_gather_object(stages, mine)
        stages = stages[:p]  # the first pipeline's stages (ranks 0..p-1); replicas mirror them
        return {
            "pp_stages": p,
            "pp_microbatches": m,
            "pp_schedule": self.opts.schedule,
            "pp_impl": self.opts.impl,
            "pp_stage_layers": self.stage_names,
            "pp_stage_params": [st["params"] for st in stages],
            "pp_bubble_fraction_theory": (p - 1) / (m + p - 1),
            # Measured over the steps after warm-up: step time minus time in this stage's compute.
            "pp_idle_s": [st["idle_s"] for st in stages],
            "pp_idle_fraction": [st["idle_fraction"] for st in stages],
            "pp_recv_wait_s": [st["recv_wait_s"] for st in stages],  # manual impl: time blocked in recv
            "pp_max_inflight_microbatches": [st["max_inflight"] for st in stages],  # manual impl
        }

    def teardown(self) -> None:
        super().teardown()
        self.schedule = self.pipe_stage = self.meta_stages = self.timer = self.replicate_group = None


@contextlib.contextmanager
def _torch_waits_traced_as_idle():
    """torch.distributed.pipelining blocks on its stage-to-stage messages in one module function,
    ``schedules._wait_batch_p2p``; wrapped here so the trace labels those waits idle (the bubble),
    as the manual loop's ``_recv`` does, instead of exposed communication. Only while this
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
