"""Zero bubble's split backward (Qi et al., arXiv 2401.10241): B, the input-gradient pass, runs
autograd as usual except that every ``nn.Linear`` and ``nn.Conv2d`` weight's gradient GEMM is not
computed: its two operands (the layer's input and the gradient of its output) are put aside;
W, the weight-gradient pass, runs those GEMMs later and accumulates into ``.grad``. This is how the
paper's own implementation splits Megatron's linear layers (a store of deferred weight-gradient
computations): only the GEMMs are deferred, and the cheap gradients (biases, norms, embeddings)
stay in B, so B + W costs what one backward does.

``DeferredWeights(modules, tracker)``: ``with deferred.pass_of(key):`` around a backward puts the
GEMMs aside under ``key``; ``deferred.run(key)`` computes them. The operands kept are counted by
``tracker`` (pp/activations.py), so the measured activation peak includes what waits for W."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

DEFERRED_TYPES = (nn.Linear, nn.Conv2d)


class _Deferred(torch.autograd.Function):
    """y = layer(x) whose backward returns d/dx (and the bias's gradient) and hands the weight's
    gradient GEMM to ``store``."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, store):
        ctx.layer, ctx.store = layer, store
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias) if isinstance(layer, nn.Linear) else layer._conv_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        if isinstance(layer, nn.Linear):
            dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
            db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        else:
            dx, _, db = torch.ops.aten.convolution_backward(
                grad, x, weight, [weight.shape[0]], *_conv_args(layer), [ctx.needs_input_grad[0], False, True]
            )
            db = db if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.store.put(layer, x, grad)
        return dx, None, db, None, None


def _conv_args(layer: nn.Conv2d) -> tuple:
    return layer.stride, layer.padding, layer.dilation, False, [0, 0], layer.groups


def weight_grad(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The GEMM B left out: d(loss)/d(weight) from the layer's input and its output's gradient."""
    if isinstance(layer, nn.Linear):
        return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
    _, dw, _ = torch.ops.aten.convolution_backward(
        grad, x, layer.weight, None, *_conv_args(layer), [False, True, False]
    )
    return dw


class DeferredWeights:
    """The weight-gradient GEMMs of ``modules``' Linear and Conv2d layers, put aside in B and run in W."""

    def __init__(self, modules: nn.Module, pack: Callable[[torch.Tensor], Any] = lambda t: t) -> None:
        self.pack = pack  # wraps each kept operand (SavedTracker.pack: counted until W drops it)
        self.pending: dict[Any, list] = {}
        self.key: Any = None
        for layer in modules.modules():
            if type(layer) in DEFERRED_TYPES and layer.weight.requires_grad:
                if isinstance(layer, nn.Conv2d) and layer.padding_mode != "zeros":
                    continue
                layer.forward = self._forward_of(layer)

    def _forward_of(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():  # evaluation: the layer's own forward
                return type(layer).forward(layer, x)
            return _Deferred.apply(x, layer.weight, layer.bias, layer, self)

        return forward

    def put(self, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        if self.key is None:  # a backward outside a B pass (none in the loop): nothing deferred
            _accumulate(layer.weight, weight_grad(layer, x, grad))
            return
        self.pending.setdefault(self.key, []).append((layer, self.pack(x), self.pack(grad)))

    @contextlib.contextmanager
    def pass_of(self, key: Any):
        """Within: the backward is ``key``'s B pass (its GEMMs wait for ``run(key)``)."""
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def run(self, key: Any) -> None:
        """``key``'s W pass: every GEMM its B put aside, accumulated into the weights' gradients."""
        for layer, x, grad in self.pending.pop(key, []):
            _accumulate(layer.weight, weight_grad(layer, _tensor(x), _tensor(grad)))


def _tensor(packed: Any) -> torch.Tensor:
    return packed if isinstance(packed, torch.Tensor) else packed.tensor


def _accumulate(weight: nn.Parameter, grad: torch.Tensor) -> None:
    with torch.no_grad():
        if weight.grad is None:
            weight.grad = grad.detach().clone() if grad.is_meta else grad.detach()
        else:
            weight.grad.add_(grad)


def split_bytes(chunk: nn.Module, batch: int, sample_shape: tuple, loss: bool) -> tuple[int, int]:
    """(the most bytes held during the chunk's B above what its forward saved, the bytes its B
    leaves for W): one micro-batch through a copy of the (meta) chunk with its weight GEMMs
    deferred, counted by the tracker that measures the real run (pp/activations.py), so the plan
    is what the run holds, transients of B included."""
    import copy

    from parallel_lab.models import loss_target, sample_input
    from parallel_lab.strategies.pp.activations import SavedTracker

    chunk = copy.deepcopy(chunk)
    tracker = SavedTracker(chunk.parameters(), meta=True)
    deferred = DeferredWeights(chunk, tracker.pack)
    x = sample_input(chunk, batch, sample_shape)  # the gpt's first chunk: int64 token ids, no gradient
    x.requires_grad_(x.is_floating_point())
    with tracker.hooks():
        out = chunk(x)
        if loss:  # the gpt's labels are (batch, seq)
            out = F.cross_entropy(out, loss_target(out))
    forward = tracker.held
    tracker.peak = forward
    with deferred.pass_of(0):
        out.backward(torch.ones_like(out))
        del out
    return tracker.peak - forward, tracker.held
