"""Distributed test body for Megatron tensor parallelism on the vit (run with
parallel_lab.cli.run.run_ranks by tests/integration/test_tp_vit.py): each configuration trains
through the real loop in one set of ranks and is checked against things computed here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.models import build_meta_model
from parallel_lab.report.parity import Replicas
from tests.support.matrix import judge_each
from tests.support.model_parallel import DATA_SIZE, shared_plans
from tests.support.reference import vit_reference


def megatron_bytes(
    batch: int, accum: int, tokens: int, dim: int, depth: int, sp: bool, impl: str, elem: int = 4
) -> dict[str, float]:
    """The communication of one step of ``accum`` micro-batches of ``batch`` as this test derives
    it, in comm/counter.py's units (an all-reduce of B bytes counts 2B): per block and direction 2
    all-reduces of the (batch, tokens, dim) fp32 activation A; under SP each becomes an all-gather
    (counted A) + a reduce-scatter (counted A), plus the embedding's gradient gathered (A), the
    head's pool (manual: all-reduce of (batch, dim); dtensor: its input gathered, A), and once per
    step the LayerNorms' (manual: also the row biases' and the head norm's) gradients all-reduced.
    Manual SP keeps the column layers' input sharded, as Megatron does, and gathers it again in
    backward: 2 more all-gathers (A) per block. elem: bytes of an activation element (bf16: 2); the
    weights' gradients are fp32 either way."""
    a = batch * tokens * dim * elem
    if not sp:
        return {"all_reduce": accum * depth * 2 * 2 * 2 * a}
    if impl == "manual":
        grads = depth * (2 * 2 * dim + 2 * dim) + 2 * dim
        return {
            "all_gather_single": accum * (depth * 6 + 1) * a,
            "reduce_scatter_single": accum * depth * 4 * a,
            "all_reduce": accum * 2 * batch * dim * elem + 2 * 4 * grads,
        }
    return {
        "all_gather_into_tensor": accum * (depth * 4 + 2) * a,
        "reduce_scatter_tensor": accum * depth * 4 * a,
        "all_reduce": 2 * 4 * depth * 2 * 2 * dim,
    }


def saved_bytes_of_a_real_forward(runner, batch: int) -> int:
    """Distinct non-parameter storages autograd saves in one training forward + loss on this rank.

    ``runner`` is a strategy (its own forward_loss: bf16 runs on its copies of the weights) or a bare
    module (cross-entropy on its logits: the cp bodies measure the unwrapped model)."""
    is_module = isinstance(runner, torch.nn.Module)
    model = runner if is_module else runner.model
    params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor: its local tensor's
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        labels = torch.zeros(batch, dtype=torch.long)
        if is_module:
            torch.nn.functional.cross_entropy(runner(x), labels)
        else:
            runner.forward_loss(x, labels)  # bf16: on its copies of the weights
    return sum(saved.values())


def saved_bytes_of_a_sharded_forward(strategy, batch: int) -> int:
    """saved_bytes_of_a_real_forward of a strategy whose parameters change while it runs: FSDP2
    registers each unit's all-gathered (unsharded) parameters for its forward and its sharded ones
    again after it, so a parameter is whatever the module holds at the moment autograd saves."""
    saved: dict[int, int] = {}

    def local(t: torch.Tensor):
        return getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor: its local tensor's

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = {local(p).data_ptr() for p in strategy.model.parameters()}
        if local(t).data_ptr() not in params:
            saved[local(t).data_ptr()] = local(t).nbytes()
        return t

    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.forward_loss(x, torch.zeros(batch, dtype=torch.long))
    return sum(saved.values())


def check(cfg, strategy, metrics, rank: int, label: str) -> None:
    """Every collective first (full_parameters, the forward), then the assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    plan = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))[rank]
    strategy.model.train()
    measured_activations = saved_bytes_of_a_real_forward(strategy, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    if rank == 0:  # the gathered parameters are the same on every rank: one judge (2 cores, one reference)
        ref = vit_reference(cfg, DATA_SIZE)  # bf16: the bf16 reference loop and its own noise floor
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))
    row = metrics.ranks[rank]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    accum = cfg.trainer.grad_accum
    elem = 2 if cfg.strategy.precision == "bf16" else 4
    want = megatron_bytes(
        cfg.trainer.global_batch // accum, accum, 64, 64, 4, cfg.strategy.sequence_parallel, cfg.strategy.impl, elem
    )
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)


def tp_vit_body(rank: int, world_size: int, configs: dict[str, list[str]], steps: int, global_batch: int) -> None:
    """Train each configuration in turn and check it (tests/support/matrix.py judge_each)."""
    base = ["model=vit", "strategy=tp", f"world_size={world_size}", "trainer.eval_batches=0"]
    judge_each(configs, steps, global_batch, base, lambda name, _, cfg, s, m: check(cfg, s, m, rank, name))
