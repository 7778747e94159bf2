"""What autograd really saves in a forward: the count the memory estimate and the planner are checked against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from parallel_lab.models import input_shape, loss_target, sample_input


def saved_for_backward_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of batch samples."""
    x = sample_input(model, batch, input_shape(model), device="cpu")  # token ids (zeros) or an image
    return saved_by_forward(model, torch.zeros_like(x))


def saved_by_forward(module: torch.nn.Module, x: torch.Tensor, loss: bool = True) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in module(x), plus the
    cross-entropy on its logits if loss (a pipeline's last stage; an earlier stage has none)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}
    # Each counted storage kept until the count is done, as the planner keeps its own (plan/predict.py
    # _saved_hook): a node whose output feeds nothing differentiable (DeepSpeed's gate masks the
    # logits only to take an argmax) frees its saved tensor at once, and a later storage at the
    # same address would then count as the same one (measured: 64-128 bytes short, by chance).
    alive: list = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
            alive.append(storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = module(x)
        if loss:
            torch.nn.functional.cross_entropy(logits, loss_target(logits))
    return sum(saved.values())


def saved_beside_sharded_parameters(model: torch.nn.Module, run) -> int:
    """Bytes ``run()`` (one training forward and loss of an FSDP2 model) saves for backward, its
    parameters left out: FSDP2 registers each unit's all-gathered weights while the unit runs and
    its shards again after it, so a parameter is whatever the model holds when autograd saves (a
    DTensor counted by its local tensor). Each counted storage is kept alive until the count is
    done, as saved_by_forward does (a storage freed at once would let a later one at its address
    count as the same)."""
    saved: dict[int, int] = {}
    alive: list = []

    def local(t: torch.Tensor) -> torch.UntypedStorage:
        return getattr(t, "_local_tensor", t).untyped_storage()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if local(t).data_ptr() not in {local(p).data_ptr() for p in model.parameters()}:
            saved[local(t).data_ptr()] = local(t).nbytes()
            alive.append(local(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Every MoE layer's kept copies dealt to the experts in turn (copy i to expert i mod E; a
    token's k <= E copies to k different experts), after the router ran as always: the equal share
    the planner assumes (models/moe.py Routing.balanced), on real tensors. Under expert parallelism
    what a rank's experts save depends on the routing; under this routing the plan is exact."""
    from parallel_lab.models import moe

    real = moe.Routing.__init__

    def dealt(self, token, expert, gate, aux, num: int) -> None:
        real(self, token, torch.arange(len(expert), device=expert.device) % num, gate, aux, num)

    moe.Routing.__init__ = dealt
    try:
        yield
    finally:
        moe.Routing.__init__ = real


@contextlib.contextmanager
def balanced_deepspeed_routing() -> Iterator[None]:
    """balanced_routing for DeepSpeed's MoE layer (strategies/zero/ds_moe.py): its gate
    (deepspeed/moe/sharded_moe.py ``top1gating``/``top2gating``) gets the logits ``TopKGate``
    computed plus a constant that sends token i first to expert i mod E and second to i + 1 mod E,
    so every expert takes k * S / E copies, the capacity the planner assumes
    (zero/ds_moe_plan.py). The addition saves nothing for backward: the layer saves what it saves."""
    from deepspeed.moe import sharded_moe

    real = {name: getattr(sharded_moe, name) for name in ("top1gating", "top2gating")}

    def dealt(gating):
        def route(logits: torch.Tensor, *args, **kwargs):
            tokens, experts = logits.shape
            first = torch.arange(tokens, device=logits.device) % experts
            push = torch.zeros_like(logits)
            push[torch.arange(tokens), first] = 2e3
            push[torch.arange(tokens), (first + 1) % experts] = 1e3
            return gating(logits + push, *args, **kwargs)

        return route

    for name, gating in real.items():
        setattr(sharded_moe, name, dealt(gating))
    try:
        yield
    finally:
        for name, gating in real.items():
            setattr(sharded_moe, name, gating)
