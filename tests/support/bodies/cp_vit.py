"""Distributed test body for context parallelism on the vit (run with parallel_lab.cli.run.run_ranks
by tests/integration/test_cp_vit.py): each configuration trains through the real loop in one set
of ranks and is checked against things computed here."""

from __future__ import annotations

import torch.distributed as dist

from parallel_lab.models import build_meta_model
from parallel_lab.plan.predict import plan_world
from tests.support.bodies.tp_vit import saved_bytes_of_a_real_forward
from tests.support.matrix import judge_each
from tests.support.model_parallel import DATA_SIZE
from tests.support.reference import vit_reference

TOKENS, DIM, DEPTH = 64, 64, 4  # the default vit: patch 4 on 32x32 images


def cp_bytes(impl: str, cp: int, batch: int, accum: int, params: int, grad_ranks: int) -> dict[str, float]:
    """One step's communication per rank as this test derives it (comm/counter.py's units: an
    all-reduce of B bytes counts 2B): the gradients all-reduced over ``grad_ranks`` ranks (2Ψ; 0
    alone); per block and micro-batch, with A = batch x tokens/cp x dim fp32 (one rank's K):
    ring, (cp-1) hops of K and V forward, and of K, V and dK, dV backward; Ulysses, 4 all-to-alls of
    A each way; plus the head's pool, one all-reduce of (batch, dim) forward."""
    a = batch * TOKENS // cp * DIM * 4
    attention = (
        {"isend": accum * DEPTH * (cp - 1) * 2 * a * 3}
        if impl == "ring"
        else {"all_to_all_single": accum * DEPTH * 8 * a}
    )
    grads = 2 * 4 * params if grad_ranks > 1 else 0
    return {**attention, "all_reduce": accum * 2 * batch * DIM * 4 + grads}


def check(cfg, strategy, metrics, rank: int, label: str) -> None:
    """Every collective first (full_parameters, the forward), then the assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    meta = build_meta_model(cfg.model)
    plan = plan_world(cfg, type(strategy), meta)[rank]
    model = getattr(strategy.model, "module", strategy.model)
    model.train()
    measured_activations = saved_bytes_of_a_real_forward(model, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    if rank == 0:  # the parameters are the same on every rank: one judge (2 cores, one reference)
        ref = vit_reference(cfg, DATA_SIZE)
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}")
    row = metrics.ranks[rank]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    s, accum = cfg.strategy, cfg.trainer.grad_accum
    batch = cfg.trainer.global_batch // accum // (world // s.cp)
    params = sum(p.numel() for p in meta.parameters())
    want = cp_bytes(str(s.cp_impl), s.cp, batch, accum, params, world)
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)


def cp_vit_body(rank: int, world_size: int, configs: dict[str, list[str]], steps: int, global_batch: int) -> None:
    """Train each configuration in turn and check it (tests/support/matrix.py judge_each)."""
    base = ["model=vit", f"world_size={world_size}", "trainer.eval_batches=0"]
    judge_each(configs, steps, global_batch, base, lambda name, _, cfg, s, m: check(cfg, s, m, rank, name))
