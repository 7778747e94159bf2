"""Distributed test body for Megatron tensor parallelism on the gpt, its vocabulary split at both
ends (run with parallel_lab.cli.run.run_ranks by tests/integration/test_tp_gpt.py): each
configuration trains through the real loop in one set of ranks and is checked against things
computed here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.models import build_meta_model
from parallel_lab.report.parity import Replicas
from tests.support.bodies.pp_gpt import check_pp_tied
from tests.support.matrix import judge_each
from tests.support.model_parallel import DATA_SIZE, shared_plans
from tests.support.reference import GPT_RUN, GPT_SIZES, MODELS, parity_reference


def vocab_parallel_bytes(
    batch: int, accum: int, seq: int, hidden: int, layers: int, sp: bool, ln_elems: int, elem: int = 4, again=(0, 0)
) -> dict[str, float]:
    """One step's communication as this test derives it (comm/counter.py's units: an all-reduce of
    B bytes counts 2B), fp32, A = one (batch, seq, hidden) activation: per block Megatron's 2
    all-reduces of A forward and 2 backward; the embedding's partial lookups summed (A, forward),
    the head's input gradient summed (A, backward); the loss's max, sum of exp and target logit,
    each (batch, seq), fp32 (the loss is taken in fp32; elem: bytes of an activation element, bf16:
    2). SP: each block all-reduce is an all-gather + a reduce-scatter (A each), the
    column inputs gathered again backward (2 A per block); the embedding's output gradient
    gathered (A), the head's input gathered (A) and its gradient reduce-scattered (A); once per step
    the ``ln_elems`` weights that saw a rank's tokens only (LayerNorms, row biases) all-reduced.
    again: per block, the (entries, exits) trainer.recompute=full runs again in backward (an entry
    is an all-gather under SP, nothing otherwise; an exit an all-reduce, SP a reduce-scatter)."""
    a, tokens = batch * seq * hidden * elem, batch * seq * 4
    loss = 3 * 2 * tokens
    if not sp:
        return {"all_reduce": accum * ((layers * (4 + again[1]) + 2) * 2 * a + loss)}
    return {
        "all_gather_single": accum * (layers * (6 + again[0]) + 2) * a,
        "reduce_scatter_single": accum * (layers * (4 + again[1]) + 1) * a,
        "all_reduce": accum * (2 * a + loss) + 2 * 4 * ln_elems,
    }


def saved_bytes_of_a_real_loss(strategy, batch: int, seq: int) -> int:
    """Distinct non-parameter storages autograd saves in one training forward + loss on this rank."""
    params = {p.untyped_storage().data_ptr() for p in strategy.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.zeros(batch, seq, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.forward_loss(ids, torch.zeros(batch, seq, dtype=torch.long))
    return sum(saved.values())


def _whole_model(reference: str, full: list[torch.Tensor]) -> torch.nn.Module:
    """The single model with the run's gathered parameters (the logits every rank must predict)."""
    net = MODELS[reference]()
    with torch.no_grad():
        for p, value in zip(net.parameters(), full, strict=True):
            p.copy_(value)
    return net.eval()


def check(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """Every collective first (full_parameters, predict), then the assertions."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics.losses)
    full = strategy.state.full_parameters()
    ids = torch.randint(0, GPT_SIZES["vocab"], (4, GPT_SIZES["seq"]), generator=torch.Generator().manual_seed(3))
    strategy.model.eval()
    predicted = strategy.predict(ids)  # every rank's vocabulary columns gathered
    plan = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))[rank]
    strategy.model.train()
    measured_activations = saved_bytes_of_a_real_loss(strategy, plan.micro_batch, GPT_SIZES["seq"])
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    if rank == 0:  # the gathered parameters are the same on every rank: one judge (2 cores, one reference)
        bf16 = {"precision": "bf16"} if cfg.strategy.precision == "bf16" else {}  # the bf16 loop and floor
        t = cfg.trainer
        ref = parity_reference(
            reference, steps=t.steps, global_batch=t.global_batch, threads=1, data_size=DATA_SIZE, **bf16
        )
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}", Replicas.of(metrics))
    with torch.no_grad():
        whole = _whole_model(reference, full)(ids)
    bf16 = cfg.strategy.precision == "bf16"
    tol = 3e-2 if bf16 else 1e-5  # a bf16 forward's logits against the fp32 model's: bf16's rounding
    torch.testing.assert_close(predicted, whole, rtol=tol, atol=tol, msg=f"[{label}] gathered logits")
    row = metrics.ranks[rank]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    sp, h, layers = cfg.strategy.sequence_parallel, GPT_SIZES["hidden"], GPT_SIZES["layers"]
    ln_elems = layers * 2 * 2 * h + 2 * h + (layers * 2 * h if cfg.model.bias else 0)  # norms, head norm, row biases
    accum = cfg.trainer.grad_accum
    batch, seq = cfg.trainer.global_batch // accum, GPT_SIZES["seq"]
    # full recompute reruns both entries and the attention's exit; the MLP's exit only where the
    # dropout after it saves a mask (torch's checkpoint stops at the last op that saves)
    full = cfg.trainer.recompute == "full"
    again = (2 * full, full * (1 + (cfg.model.dropout > 0)))
    want = vocab_parallel_bytes(batch, accum, seq, h, layers, sp, ln_elems, 2 if bf16 else 4, again)
    assert row["comm_bytes_by_op"] == want, (label, row["comm_bytes_by_op"], want)
    assert plan.comm == want, (label, plan.comm, want)  # the planner's prediction is the formula
    assert plan.activation_bytes == measured_activations, (label, plan.activation_bytes, measured_activations)


def tp_gpt_body(
    rank: int, world_size: int, configs: dict[str, list[str]], references: dict[str, str], steps: int, global_batch: int
) -> None:
    """Train each configuration in turn, check it against its reference (tests/support/matrix.py judge_each).
    A configuration with ``strategy=pp`` (a later strategy= wins) is judged by pp_gpt.py: the tied
    embedding across a pipeline, trained in these ranks to spare a start-up."""
    base = [*GPT_RUN, "strategy=tp", f"world_size={world_size}", "trainer.eval_batches=0"]

    def judge(name: str, _, cfg, strategy, metrics) -> None:
        if cfg.strategy.name == "pp":
            return check_pp_tied(cfg, strategy, metrics, rank, name, references[name])
        return check(cfg, strategy, metrics, rank, name, references[name])

    judge_each(configs, steps, global_batch, base, judge)
