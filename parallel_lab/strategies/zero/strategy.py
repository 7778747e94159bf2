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

bf16 at stage 0 is DeepSpeed's ``FP16_UnfusedOptimizer`` around the torch optimizer; its
constructor steps the optimizer once on zero gradients, which this strategy undoes so that zero0
trains exactly as zero1/zero2 do (``_undo_stage0_init_step``, docs/zero.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from parallel_lab.choices import Choice
from parallel_lab.comm.dist_env import DistEnv, init_process_group
from parallel_lab.errors import ConfigError
from parallel_lab.strategies import register
from parallel_lab.strategies.base import OptimizerFactory, Strategy, StrategyOptions
from parallel_lab.strategies.memory import optimizer_bytes_per_param, storage_bytes
from parallel_lab.strategies.zero.ds_config import PRECISION_BYTES, build_ds_config

STAGES = (0, 1, 2, 3)
ZERO = "zero"  # the names are zero<stage>
OFFLOADS = ("none", "cpu")
PRECISIONS = ("fp32", "bf16", "fp16")


class Offload(Choice):
    """strategy.offload: where ZeRO keeps the optimizer state (stage 3: the parameters too)."""

    none = "none"
    cpu = "cpu"


class ZeroPrecision(Choice):
    """strategy.precision of zero0-3: DeepSpeed's modes (fp16 needs CUDA)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class ZeroOptions(StrategyOptions):
    """``strategy=zero0``..``zero3`` options. The stage is the name's digit."""

    # Filled in from the name (zero2 -> 2) when the config is validated; setting it is only a check.
    stage: Optional[int] = None
    # none | cpu: optimizer state + fp32 master partition on CPU (stage 3: parameters too); stages 1-3
    offload: Offload = Offload.none
    precision: ZeroPrecision = ZeroPrecision.fp32  # fp32 | bf16 (fp16 needs CUDA: refused on CPU)
    # reduce / all-gather bucket size in MiB (DeepSpeed's default, 500M elements, is 2 GB in fp32)
    bucket_mb: float = 25.0
    # a DeepSpeed JSON config of yours, taken unedited: what it sets is what the run does (batch,
    # clipping, optimizer, schedule, bf16, ZeRO keys); an explicit override contradicting it is refused
    ds_config: Optional[str] = None


def _stage_from_name(name: str) -> int:
    return int(name[len(ZERO) :])


def zero_stage(name: str) -> int | None:
    """The ZeRO stage a strategy name stands for (``zero2`` -> 2), None for any other strategy."""
    return _stage_from_name(name) if name.startswith(ZERO) and name[len(ZERO) :].isdigit() else None


def zero_name(stage: int) -> str:
    """The strategy name of a ZeRO stage (2 -> ``zero2``)."""
    return f"{ZERO}{stage}"


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
    return deepspeed


def _cpu_only(cfg: DictConfig) -> bool:
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


def _bucket_tensors(opt) -> list[torch.Tensor]:
    """The gradient reduction buckets DeepSpeed holds now: ``ipg_buckets[dtype].buffer`` is a list
    of tensors at stages 1-2 (empty outside backward) and one tensor at stage 3."""
    tensors = []
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
        buffer = getattr(bucket, "buffer", None)
        tensors += list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
    return [t for t in tensors if t is not None]


DS_TAG = "deepspeed"  # the subfolder DeepSpeed writes inside one of our step_* checkpoints


@register("zero0", "zero1", "zero2", "zero3")
class ZeroStrategy(Strategy):
    Options = ZeroOptions
    syncs_batchnorm = True

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """Stage 3 sets overlap_comm and prefetches parameters; stages 0-2 here run with overlap_comm
        off (ds_config.py): nothing hidden."""
        if zero_stage(cfg.strategy.name) == 3:
            return frozenset({"all_gather", "reduce_scatter", "all_reduce"})
        return frozenset()

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"strategy={opts.name} needs DeepSpeed, which is not installed; pip install deepspeed "
                f"(make installs it), or use strategy=fsdp for the same sharding in plain torch"
            )
        named = _stage_from_name(opts.name)
        if opts.stage is None:
            opts.stage = named
        if opts.stage not in STAGES:
            raise ConfigError(
                f"strategy.stage={opts.stage} does not exist: ZeRO has stages 0-3; choose the stage by name "
                f"(strategy=zero0, zero1, zero2 or zero3) and drop strategy.stage"
            )
        if opts.stage != named:
            raise ConfigError(
                f"strategy.stage={opts.stage} contradicts strategy={opts.name} (stage {named}); "
                f"use strategy=zero{opts.stage} instead of overriding strategy.stage"
            )
        if opts.offload != "none" and opts.stage == 0:
            raise ConfigError(
                "strategy.offload=cpu needs a partitioned optimizer (ZeRO stage 1-3); "
                "use strategy=zero1, zero2 or zero3 with offload, or strategy.offload=none"
            )
        if opts.precision == "fp16" and _cpu_only(cfg):
            raise ConfigError(
                "strategy.precision=fp16 is not supported by DeepSpeed on CPU; use strategy.precision=bf16 or fp32 "
                "(fp16 needs device=cuda)"
            )
        if opts.bucket_mb <= 0:
            raise ConfigError(f"strategy.bucket_mb={opts.bucket_mb} must be > 0; use e.g. strategy.bucket_mb=25")
        build_ds_config(cfg, opts)  # the file was read and adopted by validate() (strategies/zero/ds_file.py)

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

    @property
    def comm_theory_psi(self) -> float:
        # ZeRO paper section 7: stages 0-2 move 2Ψ per step (reduce-scatter + all-gather of the
        # gradients/parameters); stage 3 adds one more all-gather of the parameters for backward.
        # In bf16 DeepSpeed reduces and gathers bf16 tensors: half the bytes (measured: 1.5 / 1.03
        # at stages 1-2 / 3 for fp32's 3.0 / 2.05 on the cnn, docs/parity.md).
        return (3.0 if self.opts.stage == 3 else 2.0) * PRECISION_BYTES[self.opts.precision] / 4

    def __init__(self, cfg: DictConfig, env: DistEnv) -> None:
        super().__init__(cfg, env)
        self.engine = None
        self.ds_config = build_ds_config(cfg, self.opts)
        self._grads_before_reduction = 0
        self._bucket_peak = 0
        self._init_step = None  # stage 0 in 16 bits: what became of DeepSpeed's optimizer step at init

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        deepspeed = import_deepspeed()
        model = model.to(self.device)
        optimizer = make_optimizer(model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        self.model = self.engine
        self._undo_stage0_init_step()
        opt = self.engine.optimizer
        if self.opts.stage == 1 and hasattr(opt, "reduce_gradients"):
            self._measure_before_reduction(opt)
        if hasattr(opt, "_release_ipg_buffers"):
            self._measure_ipg_buckets(opt)

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

    def _measure_before_reduction(self, opt) -> None:
        """Wrap this optimizer instance's boundary reduction to read the gradient bytes held just
        before it (afterwards DeepSpeed keeps only this rank's partition): every parameter's whole
        gradient, plus (offload) the fp32 gradient partition that lives from init on."""
        reduce = opt.reduce_gradients

        def measured_reduce(*args, **kwargs):
            self._grads_before_reduction = storage_bytes(self._grad_tensors())
            return reduce(*args, **kwargs)

        opt.reduce_gradients = measured_reduce

    def _measure_ipg_buckets(self, opt) -> None:
        """Stages 1-2 allocate their reduction bucket(s) (``ipg_buckets[dtype].buffer``, a list:
        one buffer of reduce_bucket_size elements, two with overlap_comm) when backward starts and
        free them at its end (``_release_ipg_buffers``); read them just before they go. Stage 3
        keeps its one bucket for the whole run (read after backward)."""
        release = opt._release_ipg_buffers

        def measured_release(*args, **kwargs):
            self._bucket_peak = max(self._bucket_peak, storage_bytes(_bucket_tensors(opt)))
            return release(*args, **kwargs)

        opt._release_ipg_buffers = measured_release

    def _input_dtype(self) -> torch.dtype:
        # bf16 engines hold bf16 weights and expect bf16 inputs; the loss is computed in fp32.
        return next((p.dtype for p in self.engine.module.parameters()), torch.float32)

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.engine(inputs.to(self._input_dtype())).float(), targets)

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

    # ----- checkpoints: DeepSpeed's own format, each rank writing its optimizer partition -----
    def save_checkpoint(self, directory: Path) -> None:
        # save_latest=False: our complete.json, not DeepSpeed's "latest" file, says what is finished.
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)

    def load_checkpoint(self, directory: Path) -> None:
        from parallel_lab.checkpoint.ds_reader import use_weights_only_loading

        use_weights_only_loading(self.engine)
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ConfigError(
                f"checkpoint '{directory}' holds no DeepSpeed state under tag '{DS_TAG}'; "
                f"trainer.resume=never to start fresh"
            )

    # ----- resharding (trainer.reshard=true): a full state scattered into DeepSpeed's partitions -----
    @classmethod
    def reshard_refusal(cls, cfg: DictConfig) -> str | None:
        """16-bit ZeRO keeps an fp32 master beside 16-bit weights in layouts (FP16_UnfusedOptimizer at
        stage 0, BF16_Optimizer for a user's ds_config) this bridge does not fill."""
        if cfg.strategy.precision != "fp32" or cfg.strategy.ds_config:
            return (
                f"trainer.reshard=true into strategy={cfg.strategy.name} needs strategy.precision=fp32 and no "
                f"strategy.ds_config; reshard into fp32 first, or resume with the writing strategy"
            )
        return None

    @torch.no_grad()
    def load_full_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Stage 0 holds a plain replica; stages 1-2 get their flat fp32 partition cut from the full
        tensors laid out as their bit16 flat buffer; stage 3 goes through DeepSpeed's own
        ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (ZeRO, arXiv 1910.02054)."""
        opt, module = self.engine.optimizer, self.engine.module
        for name, buffer in module.named_buffers():
            buffer.copy_(model_state[name])
        if self.opts.stage == 0:
            from parallel_lab.strategies.replicated import copy_tensors_into, indexed_optimizer_state

            copy_tensors_into(module, model_state)
            opt.load_state_dict(indexed_optimizer_state(opt, module, optim_state))
            return
        names = {id(p): n for n, p in module.named_parameters()}
        step = next(iter(optim_state.values()), {}).get("step")
        if self.opts.stage == 3:
            self._load_full_stage3(opt, module, model_state, optim_state, step)
        else:
            self._load_full_stage12(opt, names, model_state, optim_state, step)
            for name, p in module.named_parameters():
                p.data.copy_(model_state[name])

    def _load_full_stage12(self, opt, names: dict, model_state: dict, optim_state: dict, step) -> None:
        """Each group's full flat vector is the bit16 flat buffer's layout (parameter offsets read
        from where each parameter's view starts); this rank keeps partition_size elements of it,
        filled parameter by parameter from the part of each that falls into the partition."""
        import torch.distributed as dist

        for g, flat in enumerate(opt.bit16_groups_flat):
            size = int(opt.partition_size[g])
            start = dist.get_rank(group=opt.real_dp_process_group[g]) * size
            master = opt.single_partition_of_fp32_groups[g]
            mine = {key: torch.zeros(size, dtype=torch.float32) for key in ("param", "exp_avg", "exp_avg_sq")}
            for p in opt.bit16_groups[g]:
                offset = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
                lo, hi = max(offset, start), min(offset + p.numel(), start + size)
                if lo >= hi:
                    continue  # the parameter lies in another rank's partition
                name = names[id(p)]
                part = slice(lo - offset, hi - offset)
                mine["param"][lo - start : hi - start] = model_state[name].flatten()[part]
                for key in ("exp_avg", "exp_avg_sq"):
                    if name in optim_state:
                        mine[key][lo - start : hi - start] = optim_state[name][key].flatten()[part]
            master.data.copy_(mine["param"])
            if step is not None:
                opt.optimizer.state[master] = {
                    "step": step.clone(),
                    **{k: mine[k].to(master.device) for k in ("exp_avg", "exp_avg_sq")},
                }

    def _load_full_stage3(self, opt, module, model_state: dict, optim_state: dict, step) -> None:
        """DeepSpeed's own setters, once the Adam state they write into exists (torch creates it
        lazily at the first step); then each parameter's partition is refreshed from the master."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if step is not None:
            for master in opt.fp32_partitioned_groups_flat:
                opt.optimizer.state[master] = {
                    "step": step.clone(),
                    "exp_avg": torch.zeros_like(master),
                    "exp_avg_sq": torch.zeros_like(master),
                }
        for name, p in module.named_parameters():
            safe_set_full_fp32_param(p, model_state[name])
            if step is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, optim_state[name][key], key)
            group, offset, numel = opt.grad_position[opt.get_param_id(p)]
            master = opt.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
            p.ds_tensor.data.narrow(0, 0, numel).copy_(master)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        # The engine: stage 3 gathers parameters collectively (every rank runs the same batches).
        return self.engine(inputs.to(self._input_dtype())).float()

    def full_parameters(self) -> list[torch.Tensor]:
        if self.opts.stage == 3:
            import deepspeed

            params = list(self.engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return [p.detach().clone().float() for p in params]
        return [p.detach().float() for p in self.engine.module.parameters()]

    # ----- memory -----
    def _param_tensors(self) -> list[torch.Tensor]:
        """What holds the model's parameters: the flat bit16 buffers (stages 0-2), or the ds_tensor
        partitions plus any gathered copies still alive (stage 3)."""
        opt = self.engine.optimizer
        params = list(self.engine.module.parameters())
        if self.opts.stage == 3:
            partitions = [p.ds_tensor for p in params] + list(getattr(opt, "fp16_partitioned_groups_flat", []))
            return partitions + [p.data for p in params]
        # bit16_groups_flat: ZeRO 1-2; bf16_groups_flat: BF16_Optimizer (a ds_config with fp32 gradient accumulation)
        return (
            [p.data for p in params]
            + list(getattr(opt, "bit16_groups_flat", []))
            + list(getattr(opt, "bf16_groups_flat", []))
        )

    def _master_tensors(self) -> list[torch.Tensor]:
        """DeepSpeed's fp32 partitions the optimizer updates."""
        opt = self.engine.optimizer
        if self.opts.stage == 3:
            return list(getattr(opt, "fp32_partitioned_groups_flat", []))
        # stages 1-2: the fp32 partition; BF16_Optimizer (a user's ds_config with fp32 gradient
        # accumulation) its fp32 partition too; stage 0 in bf16/fp16: FP16_UnfusedOptimizer's fp32
        # copy of every parameter (fp32_groups, a list per group), FP16_Optimizer's flat one
        tensors = list(getattr(opt, "single_partition_of_fp32_groups", []))
        tensors += list(getattr(opt, "fp32_groups_flat_partition", [])) + list(getattr(opt, "fp32_groups_flat", []))
        for group in getattr(opt, "fp32_groups", None) or []:
            tensors += list(group) if isinstance(group, (list, tuple)) else [group]
        return tensors

    def _grad_tensors(self) -> list[torch.Tensor | None]:
        """Every gradient buffer alive now: the module's .grad, the averaged partition gradients
        (stages 1-2) or the flat gradient partition (stage 3), and the fp32 master's .grad, which
        with offload DeepSpeed allocates at init and keeps (stages 1-3: 4 bytes per partition
        element; without offload the step creates and frees it)."""
        opt = self.engine.optimizer
        averaged = getattr(opt, "averaged_gradients", None) or {}
        grads = [p.grad for p in self.engine.module.parameters()] + [m.grad for m in self._master_tensors()]
        for value in averaged.values() if isinstance(averaged, dict) else averaged:
            grads += value if isinstance(value, (list, tuple)) else [value]
        if self.opts.stage == 3:
            grads.append(getattr(opt, "grad_partitions_flat_buffer", None))
        else:
            grads.append(getattr(opt, "grads_in_partition", None))
            grads += list(getattr(opt, "fp32_groups_gradients_flat", []))  # BF16_Optimizer's fp32 accumulators
        return grads

    def memory_after_backward(self) -> dict[str, int]:
        """Parameters and every gradient buffer alive after backward; step() frees the averaged
        gradients and (without offload) the partitions' .grad."""
        return {
            "param_bytes": storage_bytes(self._param_tensors()),
            # Stage 1 frees the gradients outside its partition right after its one reduction at
            # the end of backward; before it, every rank holds them all (the ZeRO-1 state).
            "grad_bytes": max(storage_bytes(self._grad_tensors()), self._grads_before_reduction),
            "comm_buffer_bytes": self._comm_buffer_bytes(),
        }

    def memory_after_step(self) -> dict[str, int]:
        """The optimizer's state on this rank's partition (created by the first step) and the fp32
        master partition."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # the torch optimizer DeepSpeed steps
        states = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        params = self._param_tensors()
        # The master copy counts only where it is its own storage, not a view of the parameters.
        master_bytes = storage_bytes(params + self._master_tensors()) - storage_bytes(params)
        return {"master_param_bytes": master_bytes, "optim_bytes": storage_bytes(states)}

    def _comm_buffer_bytes(self) -> int:
        """Buffers beside the model state that hold data in transit: the gradient reduction
        bucket(s) (DeepSpeed 0.19.8 keeps them in ``ipg_buckets[dtype].buffer``; older releases had
        one ``ipg_buffer`` list) and, with offload at stages 1-2, the staging copies between device and
        host: two gradient buffers of the largest parameter (``temp_grad_buffer_for_{gpu,cpu}_offload``)
        and the 16-bit copy of the updated partition (``param_buffer_of_bit16_for_cpu_offload_groups``)."""
        opt = self.engine.optimizer
        staging = [getattr(opt, "temp_grad_buffer_for_gpu_offload", None)]
        staging += [getattr(opt, "temp_grad_buffer_for_cpu_offload", None)]
        staging += list(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or [])
        buckets = max(self._bucket_peak, storage_bytes(_bucket_tensors(opt)))
        return buckets + storage_bytes(staging)

    def analytic_memory(self, num_params: int) -> dict[str, int]:
        """ZeRO paper (arXiv 1910.02054) per rank, generalised to this precision: weights w and
        gradients g bytes/param (4 in fp32, 2 in bf16), Adam 8 (SGD+momentum 4) of optimizer
        state; stage >= 1 divides the optimizer state by N, >= 2 the gradients, 3 the weights.
        master: DeepSpeed's fp32 master partition where it is a separate copy (4/N)."""
        n = self.env.world_size
        stage = self.opts.stage
        w = PRECISION_BYTES[self.opts.precision]
        k = optimizer_bytes_per_param(self.cfg.trainer)
        # DeepSpeed 0.19.8 keeps its fp32 master partition as a separate copy at stages 1-3
        # (measured, fp32 included), and an unpartitioned one for bf16 at stage 0.
        separate_master = stage >= 1 or self.opts.precision != "fp32"
        return {
            "param_bytes": int(w * num_params / (n if stage >= 3 else 1)),
            "master_param_bytes": int(4 * num_params / (n if stage >= 1 else 1)) if separate_master else 0,
            "grad_bytes": int(w * num_params / (n if stage >= 2 else 1)),
            "optim_bytes": int(k * num_params / (n if stage >= 1 else 1)),
        }

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
        """DeepSpeed's flat buffers, padding and partition boundaries per stage (``predict.py``)."""
        from parallel_lab.strategies.zero.predict import predict_zero_memory

        return predict_zero_memory(cfg, model, rank)

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
        from parallel_lab.strategies.zero.predict import predict_zero_comm

        return predict_zero_comm(cfg, model, rank)

    def extra_metrics(self) -> dict:
        extras = {"zero_stage": self.opts.stage, "ds_config": self.ds_config}
        if self._init_step:
            extras["zero0_init_step"] = self._init_step
        return extras

    def teardown(self) -> None:
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()  # releases stage-3 hooks and buffers
        self.engine = None
        super().teardown()
