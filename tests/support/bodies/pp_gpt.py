"""The gpt's tied embedding under strategy=pp (parallel_lab/strategies/pp/tied.py: the last stage's
copy of the word embedding, its gradient summed with the first stage's over the embedding group),
checked in the ranks of tests/integration/test_tp_gpt.py (one start-up for both): parity with
single's tied training, the two copies bit-equal after training, every rank's model state,
communication and activation peak as planned and as derived here (the copy's 4 V h bytes on the
last stage, the all-reduce of V h fp32 gradients on both ends), and a checkpoint that holds single's
names (one ``embed`` weight) from which a resharded load sets both copies."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallel_lab.checkpoint import Checkpointer
from parallel_lab.checkpoint.full_state import consolidate
from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.models import build_meta_model
from tests.support.model_parallel import DATA_SIZE, assert_state_as_planned, judge_gpt_on_rank0, shared_plans
from tests.support.reference import GPT_SIZES, MODELS, parity_reference

TIED = "embed.tokens.weight"


def embedding_copy(strategy) -> torch.Tensor | None:
    """This rank's copy of the word embedding (the first stage's weight, the last stage's copy)."""
    held = dict(strategy.model.named_parameters())
    return held[TIED].detach().clone() if TIED in held else None


def shared_directory() -> str:
    """A fresh folder every rank writes into (made by rank 0)."""
    folder = [tempfile.mkdtemp(prefix="pp_tied_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def reshard_round_trip(cfg, strategy) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Save a checkpoint through the real Checkpointer, read it back as the strategy-neutral full
    state, then load that state (its embedding shifted by 1, so a copy left unset shows) into the
    strategy as trainer.reshard=true does. (full state's parameter names, its embedding, the shifted
    one, this rank's copy after the load). Collective."""
    folder = shared_directory()
    run = OmegaConf.merge(cfg, {"trainer": {"checkpoint_dir": folder}})
    path = Checkpointer(run, read_dist_env("cpu"), strategy).save(cfg.trainer.steps, 0, {})
    full = consolidate(path, cfg.model)
    saved = full.model[TIED]
    model = {name: full.model[name] for name in full.model}
    model[TIED] = saved + 1.0
    strategy.state.load_full(model, full.optim)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return list(full.param_names), saved, model[TIED], embedding_copy(strategy)


def stage_numels(reference: str, layers: list[str]) -> int:
    """Parameters of the single model's blocks ``layers`` (the tied head: its norm only)."""
    net = MODELS[reference]()
    return sum(p.numel() for name in layers for p in net.get_submodule(name).parameters())


def check_pp_tied(cfg, strategy, metrics, rank: int, label: str, reference: str) -> None:
    """Every collective first (losses, full parameters, copies, the checkpoint round trip), then the
    assertions."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = [p.clone() for p in strategy.state.full_parameters()]  # (views of the live weights here)
    copies: list = [None] * world
    dist.all_gather_object(copies, embedding_copy(strategy))
    plans = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))
    names, saved, shifted, loaded = reshard_round_trip(cfg, strategy)
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    first, last = copies[0], copies[-1]
    assert first is not None and last is not None, (label, "both ends hold the embedding")
    assert torch.equal(first, last), (label, "the copies differ after training", float((first - last).abs().max()))
    single_names = [n for n, _ in MODELS[reference]().named_parameters()]
    gathered = full[single_names.index(TIED)]
    assert torch.equal(gathered, first), (label, "the gathered embedding is the first stage's")
    if rank == 0:  # the gathered parameters are the same on every rank: one judge (2 cores, one reference)
        t = cfg.trainer
        bf16 = {"precision": "bf16"} if cfg.strategy.precision == "bf16" else {}  # the bf16 loop and floor
        ref = parity_reference(
            reference, optimizer=str(t.optimizer), steps=t.steps, global_batch=t.global_batch, threads=1,
            data_size=DATA_SIZE, **bf16, **({"grad_clip": t.grad_clip} if t.grad_clip else {}),
        )  # fmt: skip
        ref.assert_matches(metrics.losses, full, f"[{label}] rank {rank}")
        assert names == single_names and names.count(TIED) == 1, (label, "checkpoint names", names)
    assert torch.equal(saved, first), (label, "the checkpoint holds the trained embedding")
    assert torch.equal(loaded, shifted), (label, "a resharded load sets this end's copy")
    vocab, hidden, seq = GPT_SIZES["vocab"], GPT_SIZES["hidden"], GPT_SIZES["seq"]
    row, extras = metrics.ranks[rank], metrics.strategy_extras
    held = stage_numels(reference, extras["pp_stage_layers"][rank]) + (vocab * hidden if rank == world - 1 else 0)
    assert row["param_bytes"] == row["grad_bytes"] == 4 * held, (label, row["param_bytes"], 4 * held)
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert row[key] == row[f"predicted_{key}"], (label, key, row[key], row[f"predicted_{key}"])
    # a step's (batch, seq, hidden) tensor (fp32, bf16: 2 bytes) out of each of the rank's chunks but
    # the last (forward) and each but the first (the gradient back); the tied weight's fp32 gradient
    # all-reduced over the two ends (counter units: 2 x bytes)
    accum, batch = cfg.trainer.grad_accum, cfg.trainer.global_batch // cfg.trainer.grad_accum
    v = cfg.strategy.virtual_stages
    n, mine = world * v, [rank + k * world for k in range(v)]
    sends = sum((g < n - 1) + (g > 0) for g in mine)
    elem = 2.0 if cfg.strategy.precision == "bf16" else 4.0
    clip = 2.0 * 8 if cfg.trainer.grad_clip > 0 else 0.0  # + the norm's float64 square sum over the pipeline
    want = {"isend": sends * accum * batch * seq * hidden * elem, "all_reduce": 2.0 * 4 * vocab * hidden + clip}
    assert plans[rank].comm == want, (label, plans[rank].comm, want)  # the planner's prediction is the formula
    # torch's stages also exchange shapes once (the first step): there the all-reduce alone
    measured, expected = row["comm_bytes_by_op"], want
    if cfg.strategy.impl == "torch":
        measured, expected = measured.get("all_reduce"), want["all_reduce"]
    assert measured == expected, (label, row["comm_bytes_by_op"], want)
    assert row["comm_bytes_by_group"]["embedding"] == want["all_reduce"] - clip, (label, row["comm_bytes_by_group"])
    measured, planned = extras["pp_activation_peak_bytes"], [plans[r].activation_bytes for r in range(world)]
    assert measured == planned, (label, measured, planned)


def check_pp_tied_replicas(cfg, strategy, metrics, rank: int, label: str) -> None:
    """dp x pp (``strategy.replicate`` pipelines) on the tied gpt, run in tests/integration/test_pp_tp.py's
    ranks (tests/support/bodies/pp_tp.py): single's training on the gathered parameters, every end's
    copy of the embedding bit-equal (both ends of every pipeline, after the replicas' average), each
    rank's model state and communication as planned, and each end's embedding-group all-reduce the
    tied weight's fp32 gradient derived here (2 x 4 V h bytes, the counter's units)."""
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, metrics.losses)
    full = [p.clone() for p in strategy.state.full_parameters()]
    copies: list = [None] * world
    dist.all_gather_object(copies, embedding_copy(strategy))
    plans = shared_plans(cfg, type(strategy), build_meta_model(cfg.model))
    assert all(x == everyone[0] for x in everyone), f"[{label}] ranks disagree on losses: {everyone}"
    ends = [c for c in copies if c is not None]
    assert len(ends) == 2 * cfg.strategy.replicate, (label, "both ends of every pipeline hold the embedding")
    assert all(torch.equal(c, ends[0]) for c in ends), (label, "the ends' copies differ after training")
    judge_gpt_on_rank0(cfg, metrics, full, rank, label, "gpt")
    row = metrics.ranks[rank]
    assert_state_as_planned(row, label)
    assert row["comm_bytes_by_op"] == plans[rank].comm, (label, row["comm_bytes_by_op"], plans[rank].comm)
    want = 2.0 * 4 * GPT_SIZES["vocab"] * GPT_SIZES["hidden"]
    assert row["comm_bytes_by_group"].get("embedding") == want, (label, row["comm_bytes_by_group"], want)
