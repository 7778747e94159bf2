"""``zero0``..``zero3``: DeepSpeed ZeRO (Rajbhandari et al., arXiv 1910.02054), one class, the
stage taken from the name.

Communication per step (N data-parallel ranks, Ψ parameters):

* stage 0: plain data parallel: gradients all-reduced in buckets (like DDP).
* stage 1: optimizer states partitioned: gradients all-reduced (or reduce-scattered) at the end
  of backward, each rank updates its 1/N partition of the fp32 weights, then the updated
  partitions are all-gathered into every rank's full parameters.
* stage 2: also gradients partitioned: gradients are reduce-scattered bucket by bucket during
  backward and each rank keeps only its partition; the same all-gather after the step.
* stage 3: also parameters partitioned: each module's parameters are all-gathered just before
  its forward and again before its backward and released after; gradients reduce-scattered.

``strategy.offload=cpu`` moves the optimizer (its states and fp32 master partition, stages 1-3)
and, at stage 3, the parameter partitions to CPU memory (ZeRO-Offload, arXiv 2101.06840). On a
CPU-only machine this changes where DeepSpeed's code paths keep tensors, not the RAM used.

The ds_config is generated from the Hydra config (``ds_config.py``) so every strategy sees the same
global batch and the same clipping. The optimizer is the toolkit's own torch optimizer, passed to
``deepspeed.initialize`` as the client optimizer: DeepSpeed steps it on its fp32 partitions, so
the update rule is exactly the one every other strategy runs (per-tensor torch Adam), and losses
match ``single``. (DeepSpeed's config Adam and DeepSpeedCPUAdam also train, but are different
kernels; ``zero_force_ds_cpu_optimizer: false`` lets the torch optimizer drive offload too.)

Memory accounting reads DeepSpeed's real buffers (distinct storages, padding included):
``param_bytes`` the model's parameter storage (the flat buffers of stages 0-2, the ``ds_tensor``
partitions of stage 3), ``master_param_bytes`` the fp32 partition the optimizer updates when it is
a separate copy (stage 0 in bf16: the fp32 copy of every parameter), ``grad_bytes`` the gradient
buffers alive after backward (stage 1: just before its one reduction; offload: with the fp32
gradient partition DeepSpeed keeps from init), ``optim_bytes`` the optimizer's state tensors after
the optimizer step, ``comm_buffer_bytes`` the gradient reduction buckets (``ipg_buckets[dtype].buffer``
in 0.19.8: stage 2 holds one for the length of backward, stage 3 for the whole run; read while they
exist) and, with offload, DeepSpeed's staging copies between device and host. The
analytic value is the paper's: fp32 weights 4 + gradients 4 + Adam 8 bytes per parameter, stage 1
dividing the optimizer state by N, stage 2 also the gradients, stage 3 also the parameters. One
difference is real and reported as its own column: at stages 1-3 DeepSpeed keeps its fp32 master
partition as a *clone* of the parameters even in fp32 (the paper's mixed-precision K=12 counts that
master copy inside the optimizer state: 4Ψ/N more per rank); stage 3 keeps one too (measured on
0.19.8). ``predict.py`` predicts every one of these buffers from the shapes alone (docs/plan.md).
The parts: ``rules.py`` (options, the paper's formula, predictions), ``state.py`` (checkpoints,
resharding), ``memory.py`` (the accounting above).

bf16 at stage 0 is DeepSpeed's ``FP16_UnfusedOptimizer`` around the torch optimizer; its
constructor steps the optimizer once on zero gradients, which this strategy undoes so that zero0
trains exactly as zero1/zero2 do (``_undo_stage0_init_step``, docs/zero.md).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from datetime import timedelta

import torch
from omegaconf import DictConfig

from parallel_lab.comm.dist_env import DistEnv, init_process_group
from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.ep.groups import ep_rank
from parallel_lab.strategies.precision import as_compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.zero.ds_config import build_ds_config
from parallel_lab.strategies.zero.ds_moe import DeepSpeedExperts
from parallel_lab.strategies.zero.memory import ZeroMemory
from parallel_lab.strategies.zero.predict import expert_flat_groups, zero_group_comm
from parallel_lab.strategies.zero.rules import STAGES, ZeroPlan, zero_name, zero_stage
from parallel_lab.strategies.zero.state import ZeroState

__all__ = ["STAGES", "ZeroStrategy", "import_deepspeed", "zero_name", "zero_stage"]

# DeepSpeed's optional optimizer, imported inside its ZeRO check (_import_muon_uncompiled).
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def quiet_deepspeed_warnings() -> None:
    """ZeRO calls deprecated torch.distributed APIs at every step; each prints a FutureWarning
    (plus a log line per rank at import). Hide exactly those, nothing else."""
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..*is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed(\.|$)")
    warnings.filterwarnings("ignore", category=UserWarning, message=r".*TypedStorage is deprecated.*")


def import_deepspeed():
    """deepspeed, imported with quiet_deepspeed_warnings() and without its CPU shared-memory comm
    op. DeepSpeed builds that C++ op (40-67 s of compiling, once per install, and again whenever
    another ninja is on PATH) when its comm backend starts, but uses it only in
    ``inference_all_reduce`` (AutoTP inference): training's all_reduce, all_gather and
    reduce_scatter are torch.distributed's either way (deepspeed/comm/torch.py, 0.19.8). Call it
    before deepspeed.init_distributed / deepspeed.initialize."""
    quiet_deepspeed_warnings()
    import deepspeed

    # By module name: the attribute deepspeed.comm.torch is torch itself (comm re-exports it).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    _import_muon_uncompiled()
    return deepspeed


def _import_muon_uncompiled() -> None:
    """DeepSpeed's ZeRO optimizers import its Muon optimizer (for isinstance checks) inside
    deepspeed.initialize, and that module wraps three kernels in torch.compile at import, which
    loads inductor: 1.6 s of a quiet core per rank per run, ~3 s on shared cores (measured).
    Imported here first with TorchDynamo off (TORCHDYNAMO_DISABLE, read at each torch.compile),
    the wrappers stay plain functions; the worker never runs Muon (it hands DeepSpeed its own
    torch optimizer: HANDED_OVER in ds_config.py), so nothing it runs changes."""
    if MUON_MODULE in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


@register("zero0", "zero1", "zero2", "zero3")
class ZeroStrategy(Strategy):
    plan = ZeroPlan
    State = ZeroState
    Memory = ZeroMemory

    @classmethod
    def init_distributed(cls, env: DistEnv, timeout_s: int) -> None:
        """DeepSpeed's own init. With RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        all exported from dist_env it skips its MPI discovery, which would pick a non-loopback
        address under mpirun (docs/facts.md)."""
        init_process_group(env, timeout_s)  # ours first (torchrun restarts need it); DeepSpeed adopts it
        if env.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips the "no GPU found" probe + notice
        deepspeed = import_deepspeed()
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        deepspeed.init_distributed(
            dist_backend=env.backend,
            auto_mpi_discovery=False,
            verbose=False,
            timeout=timedelta(seconds=timeout_s),
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
        )

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        super().__init__(cfg, env)
        self.engine = None
        self.ds_config = build_ds_config(cfg, self.opts)
        self._init_step = None  # stage 0 in 16 bits: what became of DeepSpeed's optimizer step at init
        self.experts: DeepSpeedExperts | None = None  # strategy.ep > 1: the swapped MoE layers

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        deepspeed = import_deepspeed()
        model = model.to(self.device)
        self.experts = deepspeed_experts(self, model)  # strategy.ep > 1: DeepSpeed's MoE layer (ds_moe.py)
        optimizer = make_optimizer(self.experts.param_groups(model) if self.experts else model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        self.model = self.engine
        self._undo_stage0_init_step()
        self.memory.watch(self.engine.optimizer)
        use_deepspeed_checkpointing(model, self.ds_config)

    def _undo_stage0_init_step(self) -> None:
        """bf16/fp16 at stage 0: with ZeRO off and 16-bit gradients DeepSpeed wraps the client
        optimizer in ``FP16_UnfusedOptimizer`` (``engine._do_optimizer_sanity_check`` returns
        DDP_BFLOAT16 / FP16; not BF16_Optimizer, which needs fp32 gradient accumulation or a
        pipeline), whose constructor calls ``initialize_optimizer_states()``: one ``step()`` of the
        client optimizer on zero gradients. For torch Adam that is step 1 with zero moments: no
        move, but every later bias correction is one step ahead (the first real update is 0.74x as
        large), and with weight decay the fp32 master decays once. ZeRO 1-3 never step at init.
        Undone here: the optimizer forgets that state and the fp32 master is copied back from the
        16-bit weights it was cloned from (the dummy step never touches those). Stage 0 then trains
        bit for bit as ZeRO-1/2 do in bf16 (measured, docs/zero.md). A user's ``strategy.ds_config``
        is run as DeepSpeed runs the file (tests/integration/test_ds_config.py compares them bit for bit), so
        there the step is kept; ``strategy_extras.zero0_init_step`` says which."""
        opt = self.engine.optimizer
        if self.opts.stage != 0 or not (hasattr(opt, "fp16_groups") and hasattr(opt, "refresh_fp32_params")):
            return
        if self.opts.ds_config:
            self._init_step = "kept: strategy.ds_config runs as DeepSpeed runs the file (one Adam step ahead)"
            return
        opt.optimizer.state.clear()
        opt.refresh_fp32_params()
        self._init_step = "undone: trains as zero1/zero2 do"

    def _input_dtype(self) -> torch.dtype:
        # bf16 engines hold bf16 weights and expect bf16 inputs; the loss is computed in fp32.
        return next((p.dtype for p in self.engine.module.parameters()), torch.float32)

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.engine(as_compute(inputs, self._input_dtype())).float(), targets)

    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        loss = self.forward_loss(inputs, targets)
        # The engine divides by gradient_accumulation_steps and reduces at the boundary itself.
        self.engine.backward(loss)
        if micro < num_micro - 1:
            # DeepSpeed counts micro-batches through step(): off the boundary it only advances
            # its counter; the real update is the last call, in optimizer_step.
            self.engine.step()
        return loss.detach()

    def optimizer_step(self) -> None:
        # The accumulation boundary: clipping at gradient_clipping (= trainer.grad_clip, 0 = off),
        # the optimizer step on each rank's partition, the all-gather of updated weights.
        self.engine.step()
        if self.experts is not None:
            self.experts.traffic.steps += 1

    def run_comm_theory_psi(self, num_params: int) -> float | None:
        """Under ep: the gradients' reductions and gathers of each flat group as DeepSpeed issues
        them (predict.py ``zero_group_comm``) and the exchanges the step's routing implied
        (ds_moe.py), in Ψ of the whole model (fp32: strategy.precision=bf16 is refused with ep)."""
        if self.experts is None:
            return super().run_comm_theory_psi(num_params)
        experts = {id(p) for p in self.experts.expert_parameters()}
        dense = [p.numel() for p in self.engine.module.parameters() if id(p) not in experts]
        local = [p.numel() for p in self.experts.expert_parameters()]
        groups = expert_flat_groups(dense, local, self.env.world_size, self.env.rank, self.layout.ep)
        reduced = sum(zero_group_comm(self.opts.stage, groups, 4, 4, self.cfg.trainer.grad_accum).values())
        routed = sum(self.experts.theory_bytes_per_step().values())
        return (reduced + routed) / (4 * num_params)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        # The engine: stage 3 gathers parameters collectively (every rank runs the same batches).
        return self.engine(as_compute(inputs, self._input_dtype())).float()

    def replica_parameters(self) -> dict[str, torch.Tensor]:
        """Stages 0-2: the engine's module parameters, whole on every rank after the step (the
        mesh's default). Stage 3: each module parameter is an empty placeholder and a rank holds only
        its own partition (``ds_tensor``): no two ranks hold the same bytes, nothing to compare."""
        return {} if self.opts.stage == 3 else super().replica_parameters()

    def extra_metrics(self) -> dict:
        extras = {"zero_stage": self.opts.stage, "ds_config": self.ds_config}
        if self._init_step:
            extras["zero0_init_step"] = self._init_step
        if self.experts is not None:
            extras.update(self.experts.metrics())
        return extras

    def teardown(self) -> None:
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()  # releases stage-3 hooks and buffers
        self.engine = None
        restore_functional_linear()
        super().teardown()


def restore_functional_linear() -> None:
    """Stage 3 swaps ``torch.nn.functional.linear`` for DeepSpeed's ``zero3_linear_wrap`` (its own
    autograd function: ``Init(module=...)`` in the stage-3 optimizer calls
    ``_enable_mem_efficient_linear``, deepspeed/runtime/zero/partition_parameters.py; "This will
    persist unless manually reset") and neither ``engine.destroy()`` nor anything else puts it
    back. Every later ``nn.Linear`` in the process would run it: a run after a zero3 run in the same
    ranks (tests train many configurations in one set) saved other activations (seen: 532
    bytes more per micro-batch on a pp stage). The original waits on
    ``InsertPostInitMethodToModuleSubClasses.linear_bk``, where DeepSpeed's own compile path
    restores it from (deepspeed/compile/init_z3.py); nothing happens before any stage-3 run."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(module, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def deepspeed_experts(strategy: ZeroStrategy, model: torch.nn.Module) -> DeepSpeedExperts | None:
    """The model's MoE MLPs swapped for DeepSpeed's layer, None at strategy.ep=1."""
    if strategy.layout.ep == 1:
        return None
    return DeepSpeedExperts(model, strategy.layout.ep, ep_rank(strategy.layout, strategy.env.rank))


def use_deepspeed_checkpointing(model: torch.nn.Module, ds_config: dict) -> None:
    """trainer.recompute under DeepSpeed: the model's recomputed regions (models/recompute.py) run
    through DeepSpeed's non-reentrant checkpoint (ds_checkpointing.py), configured from the ds_config's
    ``activation_checkpointing`` section, as a DeepSpeed user's model calls it. deepspeed.comm must
    be up (it is, after deepspeed.initialize). Nothing changes where the mode is none."""
    from parallel_lab.models.recompute import NONE, setting_of
    from parallel_lab.strategies.zero.ds_checkpointing import ds_checkpoint_function

    setting = setting_of(model)
    if setting is not None and setting.mode != NONE:
        setting.checkpoint = ds_checkpoint_function(ds_config)
