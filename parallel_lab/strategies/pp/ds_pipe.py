"""``strategy=pp strategy.impl=deepspeed``: DeepSpeed's own pipeline engine
(``deepspeed.pipe.PipelineModule`` + ``PipelineEngine.train_batch``) on the same stages.

The model's top-level blocks (vit: ``embed``, ``block0`` .., ``head``) become the PipelineModule's
layers, cut where ``plan.py`` cuts them for the other implementations (so the planner's per-stage
prediction holds), with the loss function on the last stage. DeepSpeed then owns the step:
``train_batch`` pulls ``strategy.microbatches x trainer.grad_accum`` micro-batches (its
``gradient_accumulation_steps``), runs its own 1F1B-like ``TrainSchedule`` with blocking
send/recv between neighbours, divides each micro-batch's loss by that count, all-reduces the
stages' gradients over the data-parallel replicas and steps the optimizer. The optimizer is the
toolkit's torch optimizer, passed as the client optimizer at ZeRO stage 0 (so the update rule,
memory accounting and checkpoints are those of every other pp run; docs/deepspeed_parallel.md
says why not ZeRO-1). DeepSpeed's ``gradient_clipping`` is off: its norm would leave out every
stage but the first (docs/facts.md); the pp strategy's clip (squares summed over the stages)
runs inside ``train_batch``, after the replicas' reduction, just before the optimizer step.

The training loop calls ``train_step`` once per ``trainer.grad_accum`` chunk: the chunks are held
and the whole optimizer step runs at the last one; the loss reported is DeepSpeed's mean over the
micro-batches (``global_mean_loss``). Evaluation, the parameter gather and checkpoints are the pp
strategy's own: ``self.model`` is the stage's blocks under their model names, the same modules
the engine trains.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections import OrderedDict

import torch
from torch import nn

from parallel_lab.strategies.base import OptimizerFactory
from parallel_lab.strategies.memory import held_param_grad_bytes
from parallel_lab.strategies.mesh import REPLICATE, Mesh
from parallel_lab.strategies.pp.chunks import ties_across_stages
from parallel_lab.strategies.pp.ds_rules import pipe_ds_config
from parallel_lab.strategies.pp.rules import chunk_modules, chunk_names, meta_model
from parallel_lab.strategies.pp.strategy import SUBCLASSES, PipelineParallelStrategy, PPMemory
from parallel_lab.strategies.pp.tied import EMBED, EmbeddingCopy, embedding_group, make_copy, tied_weight


class DSPipeMemory(PPMemory):
    """Gradients exist only inside ``train_batch`` (the engine steps and zeroes them before it
    returns): they are measured there, just before the optimizer step (``_measure_before_step``)."""

    def after_backward(self) -> dict[str, int]:
        return self.strategy.held_before_step or held_param_grad_bytes(self.model)


class DeepSpeedPipelineStrategy(PipelineParallelStrategy):
    """pp with ``strategy.impl=deepspeed`` (chosen by ``PipelineParallelStrategy.__new__``)."""

    Memory = DSPipeMemory

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> None:
        from parallel_lab.strategies.zero.strategy import ZeroStrategy, import_deepspeed, use_deepspeed_checkpointing

        ZeroStrategy.init_distributed(self.env, self.cfg.dist_timeout_s)  # adopts the group: deepspeed.comm on it
        deepspeed = import_deepspeed()
        p = self.opts.stages
        self.stage = self.layout.coords(self.env.rank)["pp"]
        self.mesh = Mesh(self.layout, self.device.type, self.comm)  # collective
        self.group = self.mesh.group("pp")
        self.pipe_ranks = self.layout.group_ranks(self.env.rank, "pp")  # evaluation's sends (rank_of)
        self.replicate_group = self.mesh.group(REPLICATE)
        meta = meta_model(self.cfg)
        # The planner's cut (strategy.balance, cuts): one chunk per rank, DeepSpeed runs no interleaving
        self.chunk_names, self.chunk_ids = chunk_names(self.cfg, meta), [self.stage]
        self.meta_chunks = chunk_modules(self.cfg, meta)
        mine = self.chunk_names[self.stage]
        children = OrderedDict(model.named_children())
        tied = ties_across_stages(self.cfg)
        # Megatron's copy of a tied embedding on the last stage (pp/tied.py), cut before the rest is freed
        held = [(EMBED, make_copy(children))] if tied and self.stage == p - 1 else []
        for name, child in children.items():
            if name not in mine:
                child.to("meta")  # this rank holds only its own stage
        if self.stage < p - 1:  # gloo sends contiguous tensors only; the vit's blocks return a transposed view
            children[mine[-1]].register_forward_hook(lambda module, args, out: out.contiguous())
        held += [(n, children[n]) for n in mine]
        self.model = nn.Sequential(OrderedDict(held)).to(self.device)
        self.chunks = [self.model]  # evaluation's chunks (the strategy's predict): the stage itself
        layers, bounds = _layers(children, self.chunk_names, held[0][1] if tied and self.stage == p - 1 else None, tied)
        with contextlib.redirect_stdout(io.StringIO()):  # PipelineModule prints its partition on rank 0
            pipe = _fixed_cut_module()(
                bounds, layers=layers, topology=_topology(self.opts.replicate, p), loss_fn=self.loss_fn
            )
        if tied:  # collective; None off the ends of each pipeline
            self.embedding_group = embedding_group(self)
            if self.embedding_group is not None:  # the engine's tied-gradient all-reduce (a sum) runs on it
                pipe.tied_pairs = [(tied_weight(self), self.embedding_group)]
        self.engine, _, _, _ = deepspeed.initialize(
            model=pipe, optimizer=make_optimizer(self.model.parameters()), config=pipe_ds_config(self.cfg)
        )
        use_deepspeed_checkpointing(model, pipe_ds_config(self.cfg))  # trainer.recompute's regions
        self.optimizer = self.engine.optimizer  # the client torch optimizer itself at ZeRO stage 0
        self._measure_before_step()
        self.shapes, self.records, self.loop = {}, [], None  # no manual loop: its own fields are null
        self.activation_peak = None  # not measured inside DeepSpeed's engine
        self.timer = BusyTimer(pipe)  # DeepSpeed calls the PipelineModule, not self.model
        self.pending, self.held_before_step, self.last_loss = [], {}, None
        self.schedule = "deepspeed"

    def _measure_before_step(self) -> None:
        """Wrap this engine's optimizer-step instruction (the engine binds the map's functions to
        itself as it runs its schedule): memory is read and the gradients clipped just before it."""
        key = _optimizer_step_instruction()
        original = self.engine._INSTRUCTION_MAP[key]

        def step(engine, **kwargs):
            self.held_before_step = held_param_grad_bytes(self.model)
            self.clip_gradients()  # pp's: trainer.grad_clip over the whole pipeline's gradient
            return original(engine, **kwargs)

        self.engine._INSTRUCTION_MAP = {**self.engine._INSTRUCTION_MAP, key: step}

    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        self.pending.append((inputs, targets))
        if micro < num_micro - 1:  # the step runs once every chunk of it is here
            return torch.zeros((), device=self.device)
        m = self.opts.microbatches
        batches = [(x, y) for xs, ys in self.pending for x, y in zip(xs.chunk(m), ys.chunk(m))]
        self.pending = []
        self.timer.busy, self.timer.enabled = 0.0, True
        start = time.perf_counter()
        self.last_loss = self.engine.train_batch(iter(batches)).detach()
        self.timer.enabled = False
        self.records.append((time.perf_counter() - start, self.timer.busy, 0.0, 0.0))
        return self.last_loss

    def optimizer_step(self) -> None:
        """Nothing left: ``train_batch`` reduced over the replicas, clipped and stepped."""

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """DeepSpeed's loss of the step: the mean over its micro-batches, averaged over the replicas
        and broadcast from the last stage, so every rank holds it."""
        return float(self.last_loss)

    def extra_metrics(self) -> dict:
        extras = super().extra_metrics()
        extras.update(pp_schedule="deepspeed TrainSchedule (1F1B order)", pp_ds_config=pipe_ds_config(self.cfg))
        return extras

    def teardown(self) -> None:
        if getattr(self, "engine", None) is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = None
        super().teardown()


class BusyTimer:
    """Time a stage spends computing inside DeepSpeed's engine, from hooks on the PipelineModule
    (the engine calls it, not the strategy, so the other impls' timed calls cannot be used):
    forward between its forward pre-hook and forward hook; backward from the moment the gradient
    of its output arrives (a hook on the output tensor) to the last accumulation into one of its
    parameters (the first layers' gradients come last)."""

    def __init__(self, module: nn.Module) -> None:
        self.busy = 0.0
        self.enabled = False
        self._start: float | None = None
        module.register_forward_pre_hook(lambda *_: self._begin())
        module.register_forward_hook(self._after_forward)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self._end(keep_open=True))

    def _after_forward(self, module, inputs, output) -> None:
        self._end()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._begin())

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _end(self, keep_open: bool = False) -> None:
        if self._start is None or not self.enabled:
            return
        now = time.perf_counter()
        self.busy += now - self._start
        self._start = now if keep_open else None


def _optimizer_step_instruction():
    from deepspeed.runtime.pipe import schedule

    return schedule.OptimizerStep


def _layers(children: dict, chunk_names: list[list[str]], copy: nn.Module | None, tied: bool):
    """The PipelineModule's layers and each stage's first index: the model's blocks in order, and a
    tied pipeline's copy of the embedding at the front of the last stage (this rank's copy on the last
    stage; elsewhere a placeholder no rank builds), so every rank cuts the same list."""
    layers, bounds = [], [0]
    for stage, names in enumerate(chunk_names):
        if tied and stage == len(chunk_names) - 1:
            layers.append(copy if copy is not None else EmbeddingCopy(nn.Embedding(1, 1, device="meta")))
        layers += [children[n] for n in names]
        bounds.append(len(layers))
    return layers, bounds


def _topology(replicate: int, stages: int):
    """Pipelines of consecutive ranks (rank = replica * stages + stage), the toolkit's layout
    (strategies/mesh.py); DeepSpeed's PipeDataParallelTopology would interleave them."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return ProcessTopology(axes=["data", "pipe"], dims=[replicate, stages])


def _fixed_cut_module():
    """A PipelineModule cut at given layer indices (the toolkit's plan), not by DeepSpeed's methods."""
    from deepspeed.pipe import PipelineModule

    class FixedCutPipelineModule(PipelineModule):
        def __init__(self, bounds: list[int], **kwargs) -> None:
            self._bounds = bounds
            super().__init__(**kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def get_tied_weights_and_groups(self) -> list:
            """The engine's tied weights (``PipelineEngine._exec_reduce_tied_grads`` all-reduces each
            one's gradient over its group before the replicas' reduction): not DeepSpeed's
            ``TiedLayerSpec``, which would build the module itself, but the toolkit's copy of the
            embedding and its embedding group (pp/tied.py)."""
            return list(getattr(self, "tied_pairs", []))

    return FixedCutPipelineModule


SUBCLASSES["deepspeed"] = DeepSpeedPipelineStrategy
