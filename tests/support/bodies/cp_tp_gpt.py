"""The gpt under ``strategy=tp strategy.cp=2 strategy.tp=2`` (world 4; trained in the context-parallel
test body's world-4 ranks, tests/support/bodies/cp_vit.py): parity with single, every cp x tp
rank's logits gathered equal to the whole model's, the model state of the vocab-parallel split to
the byte (derived here from the gpt's shapes), the bytes of the formula derived here (Megatron's
all-reduces on a rank's seq/cp tokens, the ring's or Ulysses' attention on the tp rank's heads,
the cp group's gradient average) and the planned activations against a real forward and loss."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel_lab.models import build_meta_model
from tests.support.activations import saved_beside_sharded_parameters
from tests.support.bodies.cp_gpt import cp_gpt_bytes, saved_bytes_of_a_real_loss
from tests.support.bodies.tp_gpt import _whole_model, vocab_parallel_bytes
from tests.support.model_parallel import assert_state_as_planned, judge_gpt_on_rank0, shared_plans
from tests.support.reference import GPT_SIZES

# Megatron's split of the gpt (tp/vocab.py): layers whose weight (and bias) rank r holds 1/tp of,
# along the output features / vocabulary rows, and the row layers, whose weight alone is split
COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.fc1", "mlp.gate", "embed.tokens", "head.out")
ROW = ("attn.proj", "mlp.fc2")


def split_state_elements(meta: torch.nn.Module, tp: int) -> int:
    """The parameter elements a tp rank holds, from the whole gpt's shapes: 1/tp of every column
    layer's weight and bias and of every row layer's weight, everything else whole."""
    held = 0
    for name, p in meta.named_parameters():
        layer, kind = name.rsplit(".", 1)
        split = layer.endswith(COLUMN) or (layer.endswith(ROW) and kind == "weight")
        held += p.numel() // tp if split else p.numel()
    return held


def cp_tp_gpt_bytes(cfg, grad_elements: int) -> dict[str, float]:
    """One step of one rank (comm/counter.py's units), fp32, a replica's batch b, t = seq/cp a
    rank's tokens: tp_gpt.py's vocab-parallel formula at t tokens (each block's 4 all-reduces, the
    head's f, the loss's 3 (b, t) all-reduces, the embedding's g of the rank's tokens' lookups);
    the attention's bytes on heads/tp heads (cp_gpt.py); every gradient element this rank holds
    all-reduced over its cp group, and with replicas over the replicate group (2 x 4 bytes each)."""
    s, accum = cfg.strategy, cfg.trainer.grad_accum
    cp, tp, h, layers = s.cp, s.tp, GPT_SIZES["hidden"], GPT_SIZES["layers"]
    batch, tokens = cfg.trainer.global_batch // accum // s.replicate, GPT_SIZES["seq"] // cp
    want = vocab_parallel_bytes(batch, accum, tokens, h, layers, False, 0)
    averages = 1 + (s.replicate > 1)
    want["all_reduce"] += averages * 2 * 4 * grad_elements
    kv_heads = cfg.model.kv_heads or GPT_SIZES["heads"]
    return {**want, **cp_gpt_bytes(str(s.cp_impl), cp, batch, accum, kv_heads, tp)}


def check_gpt_cp_tp(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """Every collective first (full_parameters, predict, the activations' forward), then the
    assertions."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    ids = torch.randint(0, GPT_SIZES["vocab"], (4, GPT_SIZES["seq"]), generator=torch.Generator().manual_seed(3))
    strategy.model.eval()
    predicted = strategy.predict(ids)  # the cp ranks' tokens, then the tp ranks' vocabulary columns, gathered
    meta = build_meta_model(cfg.model)
    plan = shared_plans(cfg, type(strategy), meta)[rank]
    strategy.model.train()
    measured_activations = saved_bytes_of_a_real_loss(strategy, strategy.model, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    judge_gpt_on_rank0(cfg, metrics, full, rank, label, reference)
    with torch.no_grad():
        whole = _whole_model(reference, full)(ids)
    torch.testing.assert_close(predicted, whole, rtol=1e-5, atol=1e-5, msg=f"[{label}] gathered logits")
    row = metrics.ranks[rank]
    assert_state_as_planned(row, label)
    held = split_state_elements(meta, cfg.strategy.tp)
    assert row["param_bytes"] == 4 * held, (label, row["param_bytes"], 4 * held)
    want = cp_tp_gpt_bytes(cfg, held)
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)
    if rank == 0:  # the report's comm Ψ theory (report/columns.py _theory_psi): rank 0's planned bytes, no "?"
        planned, measured = metrics.comm_planned_psi, metrics.comm_volume_psi
        assert metrics.comm_theory_psi is None and planned is not None, (label, metrics.comm_theory_psi, planned)
        assert abs(planned - measured) <= 1e-12 * measured, (label, planned, measured)


def fsdp_split_elements(meta: torch.nn.Module, tp: int, shard: int) -> int:
    """The padded elements of a rank's FSDP2 shards of its tp rank's split, from the whole gpt's
    shapes: each layer split as split_state_elements splits it (a column layer's rows, a row
    layer's weight's columns), then dim 0 cut into ``shard`` chunks, every chunk padded to the
    largest (fully_shard's padding)."""
    held = 0
    for name, p in meta.named_parameters():
        layer, kind = name.rsplit(".", 1)
        shape = list(p.shape)
        if layer.endswith(COLUMN):
            shape[0] //= tp
        elif layer.endswith(ROW) and kind == "weight":
            shape[1] //= tp
        held += -(-shape[0] // shard) * math.prod(shape[1:])
    return held


def check_gpt_fsdp_cp_tp(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """``strategy=fsdp strategy.cp=2 strategy.tp=2`` on the gpt: fully_shard over shard x cp on top
    of the manual vocab-parallel split. As check_gpt_cp_tp, with FSDP2's state and bytes derived
    here: its padded shards of the tp-local tensors over the shard x cp ranks, their 2 all-gathers
    and 1 reduce-scatter a step in place of the cp group's gradient all-reduce."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    ids = torch.randint(0, GPT_SIZES["vocab"], (4, GPT_SIZES["seq"]), generator=torch.Generator().manual_seed(3))
    strategy.model.eval()
    predicted = strategy.predict(ids)
    meta = build_meta_model(cfg.model)
    plan = shared_plans(cfg, type(strategy), meta)[rank]
    strategy.model.train()
    measured_activations = saved_bytes_of_a_sharded_loss(strategy, plan.micro_batch)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    judge_gpt_on_rank0(cfg, metrics, full, rank, label, reference)
    with torch.no_grad():
        whole = _whole_model(reference, full)(ids)
    torch.testing.assert_close(predicted, whole, rtol=1e-5, atol=1e-5, msg=f"[{label}] gathered logits")
    row, s = metrics.ranks[rank], cfg.strategy
    assert_state_as_planned(row, label)
    shard = dist.get_world_size() // s.tp  # fully_shard's ranks: shard x cp
    padded = fsdp_split_elements(meta, s.tp, shard)
    assert row["param_bytes"] == 4 * padded, (label, row["param_bytes"], 4 * padded)
    batch, accum, tokens = cfg.trainer.global_batch // (shard // s.cp), 1, GPT_SIZES["seq"] // s.cp
    want = vocab_parallel_bytes(batch, accum, tokens, GPT_SIZES["hidden"], GPT_SIZES["layers"], False, 0)
    want.update(all_gather_single=2.0 * 4 * shard * padded, reduce_scatter_single=4.0 * shard * padded)
    kv_heads = cfg.model.kv_heads or GPT_SIZES["heads"]
    want = {**want, **cp_gpt_bytes(str(s.cp_impl), s.cp, batch, accum, kv_heads, s.tp)}
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)
    if rank == 0:  # the report's comm Ψ theory: rank 0's planned bytes, no "?"
        planned, measured = metrics.comm_planned_psi, metrics.comm_volume_psi
        assert planned is not None and abs(planned - measured) <= 1e-12 * measured, (label, planned, measured)


def saved_bytes_of_a_sharded_loss(strategy, batch: int) -> int:
    """cp_gpt.py saved_bytes_of_a_real_loss through fully_shard's units (a parameter is whatever
    the model holds when autograd saves)."""
    ids = torch.zeros(batch, GPT_SIZES["seq"], dtype=torch.long)
    return saved_beside_sharded_parameters(
        strategy.model, lambda: strategy.loss_fn(strategy.model(ids), torch.zeros_like(ids))
    )
