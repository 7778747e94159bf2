"""Every aten operator one training pass runs (forward, loss, backward), counted on the meta device:
the step-time model's unit of compute (``parallel_lab.plan.steptime``).

A pass is recorded once per (model, micro-batch, dtype) under a ``TorchDispatchMode`` while a meta
forward, cross-entropy and backward run; nothing is allocated. Each operator lands in one kind:

- ``conv``: convolutions and their backward, with their FLOPs (torch's own ``flop_registry``);
- ``matmul``: mm, addmm, bmm, baddbmm and the fused attention kernels, with their FLOPs;
- ``pool``: pooling and its backward (max pooling with indices runs far below memory speed), with
  the bytes they read and write;
- ``norm``: layer/group/batch norm, softmax, GELU and their backward, with their bytes;
- ``memory``: every other operator that writes a tensor (activations, norms, pooling, adds, the
  loss), with the bytes it reads and writes (inputs + outputs);
- views (``view``, ``t``, ``detach``, ...) write nothing and are not counted.

A kind's time is then ``calls x per_call_s + units x per_unit_s`` (units: FLOPs or bytes), fitted by
``parallel_lab.plan.calibrate`` to micro-benchmarks of the same operators: a per-operator model, not
tied to any one model, so resnet18 and vit are predicted without ever being calibrated on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from parallel_lab.plan.metamemo import PlanMode

KINDS = ("conv", "matmul", "pool", "norm", "memory")
_NORM = ("norm", "softmax", "gelu")  # normalisations, softmax, GELU and their backward: compute-heavy per byte
_CONV = {"convolution", "_convolution", "convolution_backward", "convolution_overrideable", "_slow_conv2d_forward"}


def _kind(packet_name: str) -> str:
    return "conv" if packet_name in _CONV else "matmul"


@dataclass
class Census:
    """Calls and units (FLOPs for conv/matmul, bytes for memory) per kind of one forward+backward."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    units: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    # FLOPs over the operator's smallest GEMM dimension, summed: a thin matrix (3 input channels,
    # a 32-wide attention head) runs far below the machine's peak, and this term says how far.
    thin: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def add(self, kind: str, units: float, small_dim: int | None = None) -> None:
        self.calls[kind] += 1
        self.units[kind] += units
        if small_dim:
            self.thin[kind] += units / small_dim


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Counter(PlanMode):
    def __init__(self) -> None:
        super().__init__()
        self.census = Census()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.census.add(_kind(packet.__name__), float(flops), small_dim(packet.__name__, args))
        elif not _is_view(func, args, out):
            moved = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs, out)))
            self.census.add(_memory_kind(packet.__name__), float(moved))
        return out


def _memory_kind(name: str) -> str:
    if "pool" in name:
        return "pool"
    return "norm" if any(word in name for word in _NORM) else "memory"


def small_dim(name: str, args) -> int | None:
    """The smallest of a GEMM's M, N, K: a convolution's (weight: out x in/groups x kh x kw) output
    channels and in/groups x kh x kw; a matmul's operands' dimensions."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in _CONV:
        weight = tensors[2] if name == "convolution_backward" else tensors[1]
        return max(1, min(weight.shape[0], weight[0].numel()))
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = tensors[-2], tensors[-1]
        return max(1, min(a.shape[-2], a.shape[-1], b.shape[-1]))
    return None


def _is_view(func, args, out) -> bool:
    """An operator that writes nothing: aten's view ops (its schema aliases its output) or one
    returning no tensor."""
    if not _tensors(out):
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def count_pass(model: torch.nn.Module, batch: int, sample_shape: tuple | None = None) -> Census:
    """The operators of one forward, cross-entropy loss and backward of ``model`` (a meta model) on
    ``batch`` samples of ``sample_shape`` (default: the model's own input, models.input_shape); the
    model's own dtype (a bf16 run: ``model.to(torch.bfloat16)`` first)."""
    from parallel_lab.models import input_shape, loss_target, sample_input

    dtype = next(model.parameters()).dtype
    x = sample_input(model, batch, sample_shape or input_shape(model), dtype)
    counter = _Counter()
    with counter:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), loss_target(logits))
        loss.backward()
    for p in model.parameters():
        p.grad = None
    return counter.census


@functools.lru_cache(maxsize=64)
def _cached(model_key: int, batch: int, dtype: torch.dtype, recompute: str, model_ref) -> Census:
    from parallel_lab.models.recompute import recomputing

    model = model_ref()
    if dtype != torch.float32:
        import copy

        model = copy.deepcopy(model).to(dtype)
    # Under recompute the checkpointed regions run their forward again inside backward: counted
    # here because they really run (torch.utils.checkpoint on meta tensors replays them too).
    with recomputing(model, recompute):
        return count_pass(model, batch)


def census_of(
    model: torch.nn.Module, batch: int, dtype: torch.dtype = torch.float32, recompute: str = "none"
) -> Census:
    """count_pass, once per (model object, batch, dtype, trainer.recompute): the planner asks for
    the same many times."""
    import weakref

    return _cached(id(model), batch, dtype, str(recompute), weakref.ref(model))
