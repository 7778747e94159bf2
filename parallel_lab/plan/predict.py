"""Per-rank predictions for one validated config: model state (each strategy's own
``predict_memory``), communication (``predict_comm``), activations and whether it fits.

The exact model-state numbers live beside each strategy (``PlanRules.predict_memory``); this
module adds what every strategy shares: the activations autograd saves at the configured
micro-batch (a meta-device forward, so any size costs nothing) and the fit verdict.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig
from torch import nn

MODEL_STATE = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")
PREDICTED_KEYS = tuple(f"predicted_{k}" for k in MODEL_STATE)


@dataclass
class RankPlan:
    """What one rank of one strategy is predicted to hold and send."""

    strategy: str
    world_size: int
    rank: int
    params: int  # parameters of the full model
    state: dict[str, int] | None  # predict_memory (None: the strategy brings no prediction)
    comm: dict[str, float] | None  # bytes per step by collective
    activation_bytes: int  # saved for backward at the end of the forward(s) (with recompute: the regions' inputs)
    micro_batch: int
    recompute: str = "none"  # trainer.recompute
    # With recompute: the largest region's own saved tensors, recomputed in backward and held while
    # that one region's backward runs, on top of activation_bytes (0 without recompute).
    recompute_bytes: int = 0

    @property
    def model_state_bytes(self) -> int | None:
        return None if self.state is None else sum(self.state.get(k, 0) for k in MODEL_STATE)

    @property
    def total_bytes(self) -> int | None:
        """Model state + buffers (BatchNorm's running statistics) + communication buffers + activations."""
        if self.state is None:
            return None
        extra = self.state.get("comm_buffer_bytes", 0) + self.state.get("buffer_bytes", 0)
        return self.model_state_bytes + extra + self.activation_bytes + self.recompute_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes, "total_bytes": self.total_bytes}


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def saved_activation_bytes(
    module: nn.Module,
    batch: int,
    sample_shape: tuple = (3, 32, 32),
    loss: bool = True,
    dtype: torch.dtype = torch.float32,
    weight_copies: bool = False,
    recompute: str = "none",
) -> int:
    """Bytes autograd saves for backward in one forward of ``batch`` samples, and the loss when
    ``loss`` (distinct storages, parameters left out): a meta-device forward, nothing allocated.
    ``dtype``: the forward computes in it (bf16/fp16: the module itself cast, as ZeRO and FSDP's
    gathered parameters are; the logits cast back to fp32 for the loss, as every strategy takes it);
    ``weight_copies``: on a 16-bit copy of every weight made per forward instead (single/ddp's
    ``strategies/precision.py``), whose saved copies count here: they live until backward like
    activations. ``recompute``: trainer.recompute, whose checkpointed regions save only their
    inputs here (torch's non-reentrant checkpoint saves them through autograd's saved-tensor
    machinery, so the same hook counts them). tests/unit/test_plan.py and tests/unit/test_vit.py
    check each against a real forward's saved tensors."""
    return _count_saved(module, batch, tuple(sample_shape), loss, dtype, weight_copies, recompute)[0]


def recompute_peak_bytes(
    module: nn.Module,
    batch: int,
    sample_shape: tuple = (3, 32, 32),
    loss: bool = True,
    dtype: torch.dtype = torch.float32,
    weight_copies: bool = False,
    recompute: str = "none",
) -> int:
    """The largest recomputed region's own saved bytes in that forward (storages the forward keeps
    anyway left out): what backward holds on top of ``saved_activation_bytes`` while it recomputes
    one region. 0 without recompute."""
    return _count_saved(module, batch, tuple(sample_shape), loss, dtype, weight_copies, recompute)[1]


def _saved_hook(into: dict[int, int], params: set[int], alive: list) -> torch.autograd.graph.saved_tensors_hooks:
    """A hook that records every saved non-parameter storage's bytes in ``into``, saving it as is.
    ``alive`` keeps each storage referenced until the count is done: a storage freed early (a
    checkpoint's inputs, once the planner's region hook took its region's saves) would hand its
    address, the key here, to a later one."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            into[storage._cdata] = storage.nbytes()
            alive.append(storage)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _cpu_layer_norm():
    """A dispatch mode under which the meta device's LayerNorm returns its mean and rstd in the
    input's dtype, as CPU's kernel does (torch._refs.native_layer_norm converts them on CPU only;
    the meta kernel keeps CUDA's float32): a bf16 forward on CPU saves 2-byte statistics, not 4."""
    from parallel_lab.plan.metamemo import PlanMode

    class CpuLayerNorm(PlanMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.native_layer_norm.default:
                return out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype)
            return out

    return CpuLayerNorm()


def _count_saved(
    module: nn.Module,
    batch: int,
    sample_shape: tuple,
    loss: bool,
    dtype: torch.dtype,
    weight_copies: bool,
    recompute: str = "none",
) -> tuple[int, int]:
    """(bytes saved by the forward, the largest recomputed region's own saved bytes), as a CPU run
    saves them (``_cpu_layer_norm``; a CUDA run's bf16 LayerNorm statistics are 2 bytes more each)."""
    from parallel_lab.models import loss_target, sample_input
    from parallel_lab.models.recompute import recomputing

    if dtype != torch.float32 and not weight_copies:
        module = copy.deepcopy(module).to(dtype)  # meta: no memory
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}
    regions: list[dict[int, int]] = []  # per recomputed region: what it saves when it runs (in backward)
    alive: list = []
    x = sample_input(module, batch, sample_shape, dtype)  # token ids stay int64
    cpu = _cpu_layer_norm() if dtype != torch.float32 else nullcontext()
    with recomputing(module, recompute) as setting, _saved_hook(seen, params, alive), cpu:
        if setting is not None:  # a region's own saves, counted here instead of by the checkpoint
            setting.around = lambda: _saved_hook(regions.append({}) or regions[-1], params, alive)
        try:
            out = _forward(module, x, dtype, weight_copies)
        finally:
            if setting is not None:
                setting.around = None
        if loss:
            torch.nn.functional.cross_entropy(out.float() if dtype != torch.float32 else out, loss_target(out))
    transient = max((sum(n for s, n in r.items() if s not in seen) for r in regions), default=0)
    return sum(seen.values()), transient


def _forward(module: nn.Module, x: torch.Tensor, dtype: torch.dtype, weight_copies: bool) -> torch.Tensor:
    if weight_copies and dtype != torch.float32:
        copies = {name: p.to(dtype) for name, p in module.named_parameters()}
        return torch.func.functional_call(module, copies, (x,))
    return module(x)


def compute_mode(cfg: DictConfig, strategy_cls: type) -> tuple[torch.dtype, bool]:
    """(the dtype a rank's forward computes in, whether on per-forward copies of the weights):
    the strategy's own precision key (zero/single/ddp ``precision``, fsdp ``mixed_precision``)."""
    from parallel_lab.strategies.precision import Bf16Compute

    precision = cfg.strategy.get("precision") or cfg.strategy.get("mixed_precision") or "fp32"
    dtype = HALF.get(precision, torch.float32)
    return dtype, dtype != torch.float32 and issubclass(strategy_cls, Bf16Compute)


def predicted_metrics(cfg: DictConfig, strategy_cls: type, model: nn.Module, rank: int) -> dict[str, int]:
    """The ``predicted_*`` entries a run's ``ranks[k]`` record stores beside its measurement
    ({} when the strategy has no prediction for these options): the model state, and the
    communication buffers (``predicted_comm_buffer_bytes``, beside the measured ``comm_buffer_bytes``;
    not part of the model-state check)."""
    state = strategy_cls.plan.predict_memory(cfg, model, rank)
    if state is None:
        return {}
    predicted = {f"predicted_{k}": int(state.get(k, 0)) for k in (*MODEL_STATE, "comm_buffer_bytes")}
    return {**predicted, "predicted_buffer_bytes": strategy_cls.plan.predict_buffer_bytes(cfg, model, rank)}


def batchnorm_comm(cfg: DictConfig, strategy_cls: type, model: nn.Module) -> dict[str, float]:
    """Bytes per step BatchNorm adds to a rank's communication (docs/batchnorm.md): SyncBatchNorm's
    all-gather and all-reduce for every training forward, or the broadcast of the plain layers'
    running statistics after each step, over the data-parallel ranks."""
    from parallel_lab.models import norm_of
    from parallel_lab.strategies.batchnorm import running_stats_bytes, sync_comm_bytes

    dp = strategy_cls.plan.data_parallel_size(cfg)
    if strategy_cls.plan.single_process or dp < 2 or norm_of(cfg.model) == "group":
        return {}
    if norm_of(cfg.model) == "syncbatch":
        return sync_comm_bytes(model, dp, cfg.trainer.grad_accum)
    nbytes = running_stats_bytes(model)
    return {"broadcast": float(nbytes)} if nbytes else {}


def planned_comm_psi(cfg: DictConfig, strategy_cls: type, model: nn.Module, params: int) -> float | None:
    """Rank 0's planned bytes per step (``predict_comm`` + BatchNorm's) in Ψ (4 bytes a parameter):
    the "comm Ψ theory" of a strategy without a paper's formula (tp, pp: Megatron's and the
    pipeline's bytes at rank 0's boundaries). None where the strategy predicts no communication."""
    comm = strategy_cls.plan.predict_comm(cfg, model, 0)
    if comm is None:
        return None
    return (sum(comm.values()) + sum(batchnorm_comm(cfg, strategy_cls, model).values())) / (4 * params)


def _with_batchnorm(comm: dict[str, float] | None, extra: dict[str, float]) -> dict[str, float] | None:
    if comm is None or not extra:
        return comm
    return {op: comm.get(op, 0.0) + extra.get(op, 0.0) for op in {*comm, *extra}}


def _micro_batch(cfg: DictConfig, strategy_cls: type) -> int:
    dp = strategy_cls.plan.data_parallel_size(cfg)
    return max(1, cfg.trainer.global_batch // (dp * cfg.trainer.grad_accum))


class SavedBytesCache:
    """saved_activation_bytes, each distinct forward counted once per planning (the strategies and
    world sizes of one plan share forwards). The key holds the modules themselves, not their id():
    Python reuses an id once its object is gone."""

    def __init__(self) -> None:
        self._bytes: dict[tuple, tuple[int, int]] = {}

    def counted(
        self, module: nn.Module, batch: int, sample_shape: tuple, loss: bool, dtype, weight_copies: bool, recompute: str
    ) -> tuple[int, int]:
        """(saved bytes, the largest recomputed region's own saved bytes) of one forward."""
        # A pipeline stage is a new Sequential around the same blocks each time: key on the blocks.
        key = (tuple(module.children()) or module, batch, tuple(sample_shape), loss, dtype, weight_copies, recompute)
        if key not in self._bytes:
            self._bytes[key] = _count_saved(module, batch, tuple(sample_shape), loss, dtype, weight_copies, recompute)
        return self._bytes[key]

    def saved(
        self,
        module: nn.Module,
        batch: int,
        sample_shape: tuple,
        loss: bool,
        dtype,
        weight_copies: bool,
        recompute: str = "none",
    ) -> int:
        return self.counted(module, batch, sample_shape, loss, dtype, weight_copies, recompute)[0]


def recompute_of(cfg: DictConfig) -> str:
    """trainer.recompute as a plain string (none where the config predates it)."""
    value = cfg.trainer.get("recompute", "none")
    return getattr(value, "value", value)


def _activations(
    cfg: DictConfig, strategy_cls: type, model: nn.Module, rank: int, micro: int, cache: SavedBytesCache
) -> tuple[int, int, int]:
    """(activation bytes, micro-batch, recompute bytes) of this rank, as the strategy lays its
    forwards out. Recompute bytes: the largest region any of its forwards recomputes (backward
    recomputes one region at a time, whatever the number of forwards stashed)."""
    dtype, copies = compute_mode(cfg, strategy_cls)
    mode, peaks = recompute_of(cfg), [0]

    def saved(module: nn.Module, batch: int, shape: tuple, loss: bool) -> int:
        kept, transient = cache.counted(module, batch, shape, loss, dtype, copies, mode)
        peaks[0] = max(peaks[0], transient)
        return kept

    activations, mb = strategy_cls.plan.activation_bytes(cfg, model, rank, micro, saved)
    return activations, mb, peaks[0]


class Values(dict):
    """A resolved config as plain values, read like a DictConfig (``cfg.strategy.name``): the
    planner reads the config thousands of times at 1,024 ranks, and OmegaConf's checks per read
    cost more than the prediction itself."""

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @classmethod
    def of(cls, node):
        if isinstance(node, dict):
            return cls({k: cls.of(v) for k, v in node.items()})
        return [cls.of(v) for v in node] if isinstance(node, list) else node


def plan_world(
    cfg: DictConfig, strategy_cls: type, model: nn.Module, cache: SavedBytesCache | None = None
) -> list[RankPlan]:
    """Every rank's plan for one validated config (one rank's plan for all where the strategy's
    ranks do the same: ``PlanRules.ranks_differ``). ``cache``: shared by the plans of one planning."""
    from omegaconf import OmegaConf

    cfg = cfg if isinstance(cfg, Values) else Values.of(OmegaConf.to_container(cfg, resolve=True))
    micro = _micro_batch(cfg, strategy_cls)
    cache = cache or SavedBytesCache()
    differ = strategy_cls.plan.ranks_differ
    shared = None if differ else _activations(cfg, strategy_cls, model, 0, micro, cache)
    params = sum(p.numel() for p in model.parameters())
    comm = None if differ else strategy_cls.plan.predict_comm(cfg, model, 0)
    bn_comm = batchnorm_comm(cfg, strategy_cls, model)
    plans = []
    for rank in range(cfg.world_size):
        activations, mb, recomputed = shared or _activations(cfg, strategy_cls, model, rank, micro, cache)
        state = strategy_cls.plan.predict_memory(cfg, model, rank)
        if state is not None:
            state = {**state, "buffer_bytes": strategy_cls.plan.predict_buffer_bytes(cfg, model, rank)}
        plans.append(
            RankPlan(
                strategy=cfg.strategy.name,
                world_size=cfg.world_size,
                rank=rank,
                params=params,
                state=state,
                comm=_with_batchnorm(strategy_cls.plan.predict_comm(cfg, model, rank) if differ else comm, bn_comm),
                activation_bytes=activations,
                micro_batch=mb,
                recompute=recompute_of(cfg),
                recompute_bytes=recomputed,
            )
        )
    return plans
