"""pp x cp (``strategy=pp strategy.cp=2``, 2 stages x cp 2 at world 4, parallel_lab/strategies/pp/cp.py),
judged in tests/integration/test_pp_tp.py's world-4 ranks (tests/support/bodies/pp_tp.py): single's
training (the parity criterion against the plain-torch reference), every rank's model state as
planned to the byte, its bytes measured = planned = the formula derived here from the shapes, the
report's comm psi theory filled and equal to the measured, and every rank's activations saved at the
step's peak = the planner's count."""

from __future__ import annotations

import torch.distributed as dist

from parallel_lab.models import build_meta_model
from parallel_lab.report.parity import Replicas
from tests.support.model_parallel import (
    DATA_SIZE,
    assert_state_as_planned,
    judge_gpt_on_rank0,
    reference_accuracy,
    shared_plans,
)
from tests.support.reference import GPT_SIZES, vit_reference

VIT = {"tokens": 64, "hidden": 64, "kv": 64}  # the default vit: patch 4 on 32x32 images
GPT_KV = {"gpt_llama": 2, "gpt": GPT_SIZES["heads"]}  # each reference's kv heads


def pp_cp_bytes(cfg, stage_layers: list[str], stage_params: int, last: bool, reference: str | None) -> dict:
    """One rank's bytes per step as this test derives them (comm/counter.py's units: an all-reduce of
    B bytes counts 2B), B = the pipeline's per-step batch, t = T/cp its tokens: the hand-off of
    (B, t, h) fp32 (stage 0 sends the activations, stage 1 their gradient, at p = 2); per block of the
    stage the ring's (cp-1) hops of K and V forward and of K, V, dK, dV backward (K = B t kv 4) or
    Ulysses' 4 all-to-alls of q, k, v, out each way; the gradients' average over the cp group (2 x 4
    bytes a parameter); the vit's pool on the last stage, an all-reduce of (B, h)."""
    cp, batch = cfg.strategy.cp, cfg.trainer.global_batch
    gpt = cfg.model.name == "gpt"
    tokens, hidden = (GPT_SIZES["seq"], GPT_SIZES["hidden"]) if gpt else (VIT["tokens"], VIT["hidden"])
    kv = GPT_KV[reference] * hidden // GPT_SIZES["heads"] if gpt else VIT["kv"]
    t = tokens // cp
    q, k = batch * t * hidden * 4, batch * t * kv * 4
    depth = sum(name.startswith("block") for name in stage_layers)
    if str(cfg.strategy.cp_impl) == "ring":
        want = {"isend": batch * t * hidden * 4 + depth * 3 * (cp - 1) * 2 * k}
    else:
        want = {"isend": batch * t * hidden * 4, "all_to_all_single": depth * 2 * (2 * q + 2 * k)}
    want["all_reduce"] = 2 * 4 * stage_params + (2 * batch * hidden * 4 if last and not gpt else 0)
    if gpt and reference == "gpt" and (last or "embed" in stage_layers):  # tied: the ends' embedding sum
        want["all_reduce"] += 2 * 4 * GPT_SIZES["vocab"] * hidden
    return {op: float(n) for op, n in want.items()}


def check_pp_cp(cfg, strategy, metrics, rank: int, label: str, reference: str | None) -> None:
    """Every collective first (losses, full_parameters), then the assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    plans = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    if cfg.model.name == "gpt":
        judge_gpt_on_rank0(cfg, metrics, full, rank, label, reference)
    elif rank == 0:  # the gathered parameters are the same on every rank: one judge
        ref = vit_reference(cfg, DATA_SIZE)
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))
        acc = reference_accuracy(ref.net, cfg.trainer.global_batch, cfg.trainer.eval_batches)  # the pool's logits
        assert metrics.eval_accuracy == acc, f"[{label}] eval accuracy {metrics.eval_accuracy} vs reference {acc}"
    row, extras = metrics.ranks[rank], metrics.strategy_extras
    assert_state_as_planned(row, label)
    stage = strategy.stage
    params = sum(p.numel() for p in strategy.model.parameters())
    assert 4 * params == row["param_bytes"], (label, params, row["param_bytes"])
    want = pp_cp_bytes(cfg, extras["pp_stage_layers"][stage], params, strategy.is_last, reference)
    assert plans[rank].comm == want, (label, plans[rank].comm, want)
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert strategy.activation_peak == plans[rank].activation_bytes, (
        label, strategy.activation_peak, plans[rank].activation_bytes,
    )  # fmt: skip
    if rank == 0:  # the report's comm psi theory: rank 0's planned bytes, filled (no "?")
        planned, measured = metrics.comm_planned_psi, metrics.comm_volume_psi
        assert planned is not None and abs(planned - measured) <= 1e-12 * measured, (label, planned, measured)
