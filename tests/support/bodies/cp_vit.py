"""Distributed test body for context parallelism on the vit and the gpt (run with
parallel_lab.cli.run.run_ranks by tests/integration/test_cp_vit.py): each configuration trains
through the real loop in one set of ranks and is checked against things computed here (the gpt's
checks: cp_gpt.py). A configuration without a model= override is the vit's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.models import build_meta_model, build_model
from parallel_lab.report.parity import Replicas
from parallel_lab.strategies.cp.parallelize import parallelize_vit
from tests.support.bodies.cp_gpt import check_gpt, check_gpt_ep, gradient_gap_on
from tests.support.bodies.cp_tp_gpt import check_gpt_cp_tp, check_gpt_fsdp_cp_tp
from tests.support.bodies.tp_vit import saved_bytes_of_a_real_forward, saved_bytes_of_a_sharded_forward
from tests.support.fsdp_tp import add_bytes, fsdp_tp_bytes, fsdp_tp_state, hybrid_checks
from tests.support.matrix import judge_each
from tests.support.model_parallel import DATA_SIZE, shared_plans
from tests.support.reference import vit_reference

TOKENS, DIM, DEPTH = 64, 64, 4  # the default vit: patch 4 on 32x32 images


def cp_bytes(impl: str, cp: int, batch: int, accum: int, tp: int = 1) -> dict[str, float]:
    """Context parallelism's communication in one step per rank as this test derives it
    (comm/counter.py's units: an all-reduce of B bytes counts 2B): per block and micro-batch, with
    A = batch x tokens/cp x dim/tp fp32 (one rank's K): ring, (cp-1) hops of K and V forward, and
    of K, V and dK, dV backward; Ulysses, 4 all-to-alls of A each way; plus the head's pool, one
    all-reduce of (batch, dim) forward."""
    if cp == 1:  # FSDP2 x TP alone: no attention exchange, no pool
        return {}
    a = batch * TOKENS // cp * DIM // tp * 4
    attention = (
        {"isend": accum * DEPTH * (cp - 1) * 2 * a * 3}
        if impl == "ring"
        else {"all_to_all_single": accum * DEPTH * 8 * a}
    )
    return {**attention, "all_reduce": accum * 2 * batch * DIM * 4}


def gradient_gap(cfg, strategy, full: list[torch.Tensor]) -> float:
    """gradient_gap_on a batch of synthetic images (tests/support/bodies/cp_gpt.py)."""
    return gradient_gap_on(cfg, strategy, full, *make_synthetic(cfg.trainer.global_batch, 7).tensors)


def check(cfg, strategy, metrics, rank: int, label: str) -> None:
    """Every collective first (full_parameters, the forward), then the assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    gap = gradient_gap(cfg, strategy, full) if cfg.strategy.name == "ddp" else 0.0
    meta = build_meta_model(cfg.model)
    plan = shared_plans(cfg, type(strategy), meta)[rank]
    model = getattr(strategy.model, "module", strategy.model)  # DDP's module
    tp = cfg.strategy.get("tp", 1)
    if tp > 1:  # the real 2-D forward: FSDP2's gathered weights are parameters while they are registered
        strategy.model.train()
        measured_activations = saved_bytes_of_a_sharded_forward(strategy, plan.micro_batch)
    else:  # FSDP2 saves its all-gathered weights too (no activations): under fsdp the cp vit unwrapped
        if cfg.strategy.name == "fsdp":
            model = parallelize_vit(build_model(cfg.model, 0), strategy.cp_group, str(cfg.strategy.cp_impl))
        model.train()
        measured_activations = saved_bytes_of_a_real_forward(model, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    assert gap < 1e-4, (label, "gradient vs single's", gap)  # float32 reordering: ~1e-7
    if rank == 0:  # the parameters are the same on every rank: one judge (2 cores, one reference)
        ref = vit_reference(cfg, DATA_SIZE)
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))
    row = metrics.ranks[rank]
    s, accum = cfg.strategy, cfg.trainer.grad_accum
    batch = cfg.trainer.global_batch // accum // (world // (s.cp * tp))
    want = cp_bytes(str(s.cp_impl), s.cp, batch, accum, tp)
    measured = row["comm_bytes_by_op"]
    if s.name == "ddp":  # + every gradient all-reduced over all ranks, 2Ψ
        want["all_reduce"] += 2 * 4 * sum(p.numel() for p in meta.parameters())
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    if s.get("sharding") == "hybrid":  # HSDP x CP: the state and HSDP's bytes derived from the shapes
        want = add_bytes(want, hybrid_checks(meta, row, world // s.replicate, rank, label))
    elif tp == 1:  # ddp's, or fsdp's all-gathers and reduce-scatters over shard x cp, as predicted
        want = {**plan.comm, **want}
    else:  # FSDP2 x TP: the state and FSDP's and Megatron's bytes derived from the shapes (fsdp_tp.py)
        shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        state = fsdp_tp_state(shapes, world, tp, rank)
        assert {key: row[key] for key in state} == state, (label, state, row)
        more = fsdp_tp_bytes(shapes, world, tp, s.cp, batch, TOKENS, DIM)
        want = {op: more.get(op, 0.0) + want.get(op, 0.0) for op in {**more, **want}}  # grad_accum 1
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert measured == want, (label, measured, want)
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)


def cp_vit_body(
    rank: int,
    world_size: int,
    configs: dict[str, list[str]],
    steps: int,
    global_batch: int,
    references: dict[str, str] | None = None,
) -> None:
    """Train each configuration in turn and check it (tests/support/matrix.py judge_each).
    references: a gpt configuration's reference model (tests/support/reference.py MODELS)."""
    base = [f"world_size={world_size}", "trainer.eval_batches=0"]
    configs = {name: o if any(x.startswith("model=") for x in o) else ["model=vit", *o] for name, o in configs.items()}

    def judge(name: str, _, cfg, strategy, metrics) -> None:
        if cfg.model.name == "gpt" and cfg.strategy.get("ep", 1) > 1:
            return check_gpt_ep(cfg, strategy, metrics, rank, name, (references or {})[name])
        if cfg.model.name == "gpt" and cfg.strategy.name == "fsdp" and cfg.strategy.tp > 1:
            return check_gpt_fsdp_cp_tp(cfg, strategy, metrics, rank, name, (references or {})[name])
        if cfg.model.name == "gpt" and cfg.strategy.name == "tp":
            return check_gpt_cp_tp(cfg, strategy, metrics, rank, name, (references or {})[name])
        if cfg.model.name == "gpt":
            return check_gpt(cfg, strategy, metrics, rank, name, (references or {})[name])
        return check(cfg, strategy, metrics, rank, name)

    judge_each(configs, steps, global_batch, base, judge)
