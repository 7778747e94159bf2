"""The gpt's checks of the context-parallel test body (tests/support/bodies/cp_vit.py trains the
configurations; tests/integration/test_cp_vit.py names them): under cp, parity with single, the
gradient of one more batch, the planned model state, the bytes of the formula derived here and the
planned activations against a real forward's; under expert parallelism (the MoE gpt, in the same
ranks: one start-up), parity with single aux loss included, each rank's planned expert state and
the all-to-all bytes of its routing and of the dropless formula."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.data.tokens import markov_tokens
from parallel_lab.models import build_meta_model, build_model
from parallel_lab.strategies.cp.parallelize import parallelize
from tests.support.activations import balanced_routing
from tests.support.fsdp_tp import add_bytes, hybrid_checks
from tests.support.model_parallel import DATA_SIZE, assert_state_as_planned, judge_gpt_on_rank0, shared_plans
from tests.support.reference import GPT_MOE, GPT_SIZES, parity_reference


def cp_gpt_bytes(impl: str, cp: int, batch: int, accum: int, kv_heads: int, tp: int = 1) -> dict[str, float]:
    """Context parallelism's communication in one step per rank on the gpt, as this test derives it:
    per block and micro-batch, with t = seq/cp a rank's tokens, Q = batch x t x hidden fp32 (its
    queries) and K = batch x t x kv_heads x head_dim fp32 (its keys, or values): the causal ring,
    (cp-1) hops of K and V forward and of K, V and dK, dV backward (whole blocks, even where the
    mask leaves half of one unused); Ulysses, q, k, v and the output to heads and back forward, and
    the 4 inverses backward. The gpt's head is per token: no pool. Under strategy=tp a rank's
    attention holds heads/tp query and kv_heads/tp key/value heads: Q and K / tp."""
    seq, hidden, heads, layers = (GPT_SIZES[k] for k in ("seq", "hidden", "heads", "layers"))
    q = batch * (seq // cp) * hidden // tp * 4
    k = batch * (seq // cp) * kv_heads // tp * (hidden // heads) * 4
    if impl == "ring":
        return {"isend": accum * layers * (cp - 1) * 3 * 2 * k}
    return {"all_to_all_single": accum * layers * 2 * (2 * q + 2 * k)}


def _batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return markov_tokens(cfg.trainer.global_batch, GPT_SIZES["seq"], GPT_SIZES["vocab"], seed, table_seed=0).tensors


def gpt_gradient_gap(cfg, strategy, full: list[torch.Tensor]) -> float:
    """gradient_gap_on a batch of the gpt's tokens: its token cross-entropy averaged over all tokens."""
    return gradient_gap_on(cfg, strategy, full, *_batch(cfg, 7))


def gradient_gap_on(cfg, strategy, full: list[torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Relative L2 distance between the run's gradient of one more batch (DDP's, averaged over every
    rank) and the single model's gradient of the same batch at the same weights, computed here. The
    parity criterion under Adam cannot see a gradient scaled by a constant (Adam divides it out);
    this can (collective: every rank runs it)."""
    strategy.loss_fn(strategy.model(inputs), labels).backward()
    got = [p.grad for p in strategy.model.parameters()]
    ref = build_model(cfg.model, 0)
    with torch.no_grad():
        for p, weights in zip(ref.parameters(), full, strict=True):
            p.copy_(weights)
    torch.nn.functional.cross_entropy(ref(inputs), labels).backward()
    gap = sum(float((g - r.grad).pow(2).sum()) for g, r in zip(got, ref.parameters(), strict=True))
    return (gap / sum(float(r.grad.pow(2).sum()) for r in ref.parameters())) ** 0.5


def saved_bytes_of_a_real_loss(strategy, model: torch.nn.Module, batch: int) -> int:
    """Distinct non-parameter storages autograd saves in one training forward of the cp-sharded gpt
    ``model`` and the rank's loss over its tokens' labels (the strategy's)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.zeros(batch, GPT_SIZES["seq"], dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.loss_fn(model(ids), torch.zeros_like(ids))
    return sum(saved.values())


def check_gpt(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """Every collective first (full_parameters, the gradient's forward), then the assertions (the
    gradient of one more batch under ddp only, whose model is the plain module)."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    ddp = cfg.strategy.name == "ddp"
    gap = gpt_gradient_gap(cfg, strategy, full) if ddp else 0.0
    meta = build_meta_model(cfg.model)
    plan = shared_plans(cfg, type(strategy), meta)[rank]
    if ddp:
        model = strategy.model.module
    else:  # FSDP2 saves its all-gathered weights too (no activations): the cp gpt unwrapped
        model = build_model(cfg.model, 0)
        parallelize(model, strategy.cp_group, str(cfg.strategy.cp_impl))
    model.train()
    measured_activations = saved_bytes_of_a_real_loss(strategy, model, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    assert gap < 1e-4, (label, "gradient vs single's", gap)  # float32 reordering: ~1e-7
    if rank == 0:  # the parameters are the same on every rank: one judge (2 cores, one reference)
        t = cfg.trainer
        ref = parity_reference(reference, steps=t.steps, global_batch=t.global_batch, threads=1, data_size=DATA_SIZE)
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}")
    row = metrics.ranks[rank]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    s, accum = cfg.strategy, cfg.trainer.grad_accum
    batch = cfg.trainer.global_batch // accum // (world // s.cp)
    want = cp_gpt_bytes(str(s.cp_impl), s.cp, batch, accum, cfg.model.kv_heads or GPT_SIZES["heads"])
    if ddp:  # + every gradient all-reduced over all ranks, 2Ψ
        want["all_reduce"] = 2 * 4 * sum(p.numel() for p in meta.parameters())
    elif s.get("sharding") == "hybrid":  # HSDP x CP: the state and HSDP's bytes from the shapes (fsdp_tp.py)
        want = add_bytes(want, hybrid_checks(meta, row, world // s.replicate, rank, label))
    else:  # fully_shard's gathers and reduce-scatters over shard x cp, as predicted
        want = {**plan.comm, **want}
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)


def check_gpt_ep(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """strategy.ep on the MoE gpt, as tests/integration/test_ep.py judges the vit: parity with the
    single reference (SGD: an expert gradient summed over the ep group instead of averaged would
    show at once, where Adam divides it out), the planned state to the byte with half the experts a
    rank, and the exchanges' bytes: this rank's measured all-to-all equals what its routing implied
    (the strategy's record), and over the ranks every token's k copies of h fp32 elements went out
    and came back, forward and backward: 4 x B x seq x k x h x 4 bytes per MoE layer and step, the
    planner's balanced prediction times the ranks; and, under the planner's equal share of the
    copies, the activations a forward saves on each rank the planned ones."""
    full = strategy.state.full_parameters()
    theory = strategy.experts.theory_bytes_per_step()
    plan = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))[rank]
    model = strategy.model.module  # DDP's: its forward exchanges tokens (collective)
    model.train()
    with balanced_routing():  # the planner's equal share; what a rank's experts save depends on it
        measured_activations = saved_bytes_of_a_real_loss(strategy, model, plan.micro_batch)
    judge_gpt_on_rank0(cfg, metrics, full, rank, label, reference)
    row = metrics.ranks[rank]
    assert_state_as_planned(row, label)
    assert row["param_bytes"] < row["analytic_param_bytes"], (label, "half of the experts a rank")
    measured = row["comm_bytes_by_op"]
    assert measured["all_to_all_single"] == theory["all_to_all_single"], (label, measured, theory)
    moe_layers = GPT_SIZES["layers"] // 2  # moe_every=2: block 1
    ep, experts = cfg.strategy.ep, GPT_MOE["moe_experts"]
    assert measured["all_gather_single"] == theory["all_gather_single"] == moe_layers * ep * experts * 8, label
    total = sum(r["comm_bytes_by_op"]["all_to_all_single"] for r in metrics.ranks)
    k, h, seq = GPT_MOE["moe_topk"], GPT_SIZES["hidden"], GPT_SIZES["seq"]
    assert total == moe_layers * 4 * cfg.trainer.global_batch * seq * k * h * 4, (label, total)
    # the planner's exchanges with every expert equally loaded: the same total, an equal share a rank
    assert plan.comm["all_to_all_single"] * len(metrics.ranks) == total, (label, plan.comm, total)
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)
