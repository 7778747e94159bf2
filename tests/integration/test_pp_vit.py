"""Pipelines on model=vit (equal blocks) on real ranks, several configurations in one set of 2
ranks: with dropout each trains as single does (every stage draws single's per-sample masks), the
bytes autograd held at the step's peak are the planner's per rank (1F1B below GPipe), a cut by
hand-given block times is the ranks' cut; and (extra) the measured idle of every stage is the
schedule's bubble. The orders and formulas in-process: tests/unit/test_pipeline_parallel.py."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.reference import parity_reference

STEPS, BATCH = 5, 16  # tests/integration/test_vit.py's: the same dropout reference
RUN = ("model=vit", "model.dropout=0.1", "data.size=4096", "trainer.eval_batches=0")
ZB_PASSES = [
    "strategy.balance=time",
    "strategy.block_times=[1.0,1.0,1.0,1.0,1.0,1.0]",  # the cut: embed, block0, block1 | block2, block3, head
    "strategy.pass_times=[[1.2,1.1,0.7],[0.1,0.1,0.1],[0.1,0.1,0.1],[0.4,0.05,0.7],[0.1,0.05,0.1],[0.1,0.1,0.1]]",
]
CONFIGS = {
    "gpipe": ["strategy.schedule=gpipe"],
    "1f1b": ["strategy.schedule=1f1b"],
    "interleaved": ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
    # weight gradients deferred (pp/zero_bubble.py), the order built from these per-block F, B, W
    # (pp/zb_orders.py): stage 1 runs each W right after its B, where ZB-H1's fixed order defers it and
    # holds 1.5x the bytes (planted: the planner playing ZB-H1's order planned 4534628 for the 2960580 held)
    "zero_bubble": ["strategy.schedule=zero_bubble", *ZB_PASSES],
}
# block3 alone costs more than the rest together: the only best cut puts it with the head
TIME_GIVEN = {"time-given": ["strategy.balance=time", "strategy.block_times=[1,1,1,1,10,1]"]}


def machine_busy_s() -> float:
    """CPU seconds every process of this machine has used since boot (/proc/stat: all but idle
    and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pp_vit_body(rank: int, world_size: int, configs: dict, steps: int, global_batch: int, run: list, out: str) -> None:
    """Train each configuration in turn through the real loop; rank 0 saves the gathered final
    parameters; print one JSON line: id -> (losses, strategy_extras, resolved strategy options)."""
    from omegaconf import OmegaConf

    from tests.support.model_parallel import train_configuration

    results = {}
    for name, overrides in configs.items():
        base = ["strategy=pp", f"world_size={world_size}", f"strategy.stages={world_size}", *run]
        machine, own, wall = machine_busy_s(), time.process_time(), time.perf_counter()
        cfg, strategy, metrics = train_configuration(steps, global_batch, *base, *overrides)
        machine, own, wall = machine_busy_s() - machine, time.process_time() - own, time.perf_counter() - wall
        ranks: list = [None] * world_size
        dist.all_gather_object(ranks, own)  # every thread of each rank
        params = strategy.state.full_parameters()  # collective
        if rank == 0:  # in the single model's order
            torch.save(params, Path(out) / f"{name}.pt")
        results[name] = {
            "losses": metrics.losses,
            "extras": metrics.strategy_extras,
            "config": OmegaConf.to_container(cfg, resolve=True),
            # the share of the machine's CPUs other processes took while this configuration trained
            "foreign_cpu": max(machine - sum(ranks), 0.0) / (os.cpu_count() * wall),
        }
        strategy.teardown()
        dist.barrier()
    print(json.dumps(results))


def run_pp_vit(configs: dict, tmp: Path, steps: int = STEPS, global_batch: int = BATCH, run=RUN) -> dict:
    from parallel_lab.cli.run import run_ranks

    kwargs = dict(configs=configs, steps=steps, global_batch=global_batch, run=list(run), out=str(tmp))
    outputs = run_ranks(pp_vit_body, 2, timeout=400, **kwargs)
    return json.loads(outputs[0].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("pp_vit")
    return run_pp_vit(CONFIGS, tmp), tmp


def planned_activations(config: dict) -> list[int]:
    """The planner's activation bytes per rank for the run's own resolved config."""
    from omegaconf import OmegaConf

    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class

    cfg = OmegaConf.create(config)
    return [p.activation_bytes for p in plan_world(cfg, get_strategy_class("pp"), build_meta_model(cfg.model))]


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("config", list(CONFIGS))
def test_pp_with_dropout_trains_the_vit_as_single_does(runs, config):
    """Every stage keys its micro-batches from the pixels (pp/manual.py): single's masks."""
    results, tmp = runs
    reference = parity_reference("vit_dropout", steps=STEPS, global_batch=BATCH)
    params = torch.load(tmp / f"{config}.pt", weights_only=True)
    verdict = reference.verdict(results[config]["losses"], params, f"vit pp {config} dropout")
    assert verdict.passed, f"{config}: not single's training: {verdict.reason()}"


@pytest.mark.slow
def test_measured_activation_peaks_are_the_plans_and_1f1b_holds_less(runs):
    results, _ = runs
    measured = {name: r["extras"]["pp_activation_peak_bytes"] for name, r in results.items()}
    for name, r in results.items():
        assert measured[name] == planned_activations(r["config"]), name
    assert all(a < b for a, b in zip(measured["1f1b"], measured["gpipe"])), measured
    print("activation peaks (bytes per rank):", json.dumps(measured))


@pytest.mark.slow
def test_each_stages_step_splits_into_compute_and_its_waits(runs):
    """The per-stage breakdown docs/pp.md explains the idle with: a stage's step is its compute
    plus its idle, and the time blocked in recv and in isend calls (hand-offs) is part of the
    idle, never of the compute. Every receive of a step is posted at its start (pp/manual.py), so
    its tensor crosses while the stage computes: gloo moves nothing until the receiver asks, and a
    receive posted only when needed waits for the whole transfer. The hand-offs' measured costs
    (pp_handoff_*, pp/handoffs.py) are per stage, and an op's time outside its compute is idle."""
    for name, r in runs[0].items():
        e = r["extras"]
        assert e["pp_recvs_posted_late"] == [0, 0], (name, e["pp_recvs_posted_late"])
        assert len(e["pp_handoff_steps"][0]) == len(e["pp_idle_fraction_steps"][0]), name  # the same steps
        assert all(lat > 0 for lat in e["pp_handoff_latency_s"][1:]), (name, e["pp_handoff_latency_s"])
        for s, step in enumerate(e["pp_step_s"]):
            assert step == pytest.approx(e["pp_busy_s"][s] + e["pp_idle_s"][s]), (name, s)
            assert 0 < e["pp_send_s"][s] and e["pp_recv_wait_s"][s] + e["pp_send_s"][s] <= e["pp_idle_s"][s], (name, s)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
def test_pp_bf16_with_dropout_trains_as_single_bf16(tmp_path):
    """bf16 (1F1B): the stage without the embed keys each micro-batch from its pixels in bf16, as
    the embed sees them (pp/manual.py), so every stage draws single bf16's masks; judged against
    the bf16 reference loop and its own floor, with the planned activation peaks (the bf16 weight
    copies among them). Keyed from the fp32 pixels it fails (early |dloss| 33x the envelope).
    Extra: the bf16 dropout reference costs about a minute; test_bf16.py's row pp keeps pp's bf16
    in make test."""
    results = run_pp_vit({"1f1b-bf16": ["strategy.schedule=1f1b", "trainer.precision=bf16"]}, tmp_path)
    result = results["1f1b-bf16"]
    reference = parity_reference("vit_dropout", steps=STEPS, global_batch=BATCH, precision="bf16")
    params = torch.load(tmp_path / "1f1b-bf16.pt", weights_only=True)
    verdict = reference.verdict(result["losses"], params, "vit pp 1f1b bf16 dropout")
    assert verdict.passed, f"not single bf16's training: {verdict.reason()}"
    assert result["extras"]["pp_activation_peak_bytes"] == planned_activations(result["config"])


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
def test_time_balance_cuts_where_the_block_times_say(runs, tmp_path):
    """The ranks cut by the times config.yaml holds (the parent's measurement, or these by hand).
    Default suite: tests/unit/test_pipeline_parallel.py
    test_time_balance_is_measured_once_in_the_parent_and_cuts_by_it."""
    extras = run_pp_vit(TIME_GIVEN, tmp_path)["time-given"]["extras"]
    assert extras["pp_stage_layers"] == [["embed", "block0", "block1", "block2"], ["block3", "head"]]
    assert extras["pp_block_times_s"] == [1, 1, 1, 1, 10, 1] and extras["pp_balance"] == "time"
    flops_cut = [["embed", "block0", "block1"], ["block2", "block3", "head"]]
    assert runs[0]["gpipe"]["extras"]["pp_stage_layers"] == flops_cut


# ----- the bubble, measured (extra: timing on a shared machine) -----
# Every chunk 4 blocks deep: each hand-off (a 1 MiB activation or gradient through gloo's TCP, a
# fixed cost per micro-batch per chunk the formula does not have) is then the same small share of
# an op under every schedule. At depth 4 a chunk is 2 blocks (interleaved: 1) and the hand-offs
# alone took the idle past the formula + 0.05 (docs/pp.md, "Measured idle vs the formula").
IDLE_RUN = ("model=vit", "data.size=4096", "trainer.eval_batches=0", "trainer.warmup_steps=2")
IDLE_STEPS = 14  # the median of 12 measured steps: one step's idle varies by 0.1 and more on this machine
IDLE_CONFIGS = {
    "gpipe": ["strategy.schedule=gpipe", "model.depth=8"],
    "1f1b": ["strategy.schedule=1f1b", "model.depth=8"],
    "interleaved": ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2", "model.depth=16"],
    "zero_bubble": ["strategy.schedule=zero_bubble", "model.depth=8"],
}


def handoff_s(extras: dict, steps: int) -> float:
    """The measured cost of one hand-off: the seconds the stages spent in isend calls over the
    measured steps, per send (each F of a chunk before the last, each B of a chunk after the first)."""
    from parallel_lab.strategies.pp.schedules import rank_orders

    p, m, v = extras["pp_stages"], extras["pp_microbatches"], extras["pp_virtual_stages"]
    n, orders = p * v, rank_orders(extras["pp_schedule"], m, p, v)
    sends = sum(
        (op == "F" and c * p + r < n - 1) or (op == "B" and c * p + r > 0) for r in range(p) for op, c, _ in orders[r]
    )
    return sum(extras["pp_send_s"]) / (sends * steps)


def replayed(extras: dict, steps: int) -> list[float]:
    """Each stage's idle in its order played out with each measured step's own compute per op
    (each op its own, pp_handoff_steps' "compute") and the measured isend cost on every crossing
    (``handoff_s``), the median step's (schedules.replay_idle_steps: the statistic of
    pp_idle_fraction). Not the run's other measured hand-off costs (pp_handoff_steps' time outside
    compute per op and crossing latency, bench bubbles): they replay a loop that waits as it
    waited, and this check is there to catch one."""
    from parallel_lab.strategies.pp.handoffs import compute_only
    from parallel_lab.strategies.pp.schedules import replay_idle_steps

    p, m, v = extras["pp_stages"], extras["pp_microbatches"], extras["pp_virtual_stages"]
    costs = compute_only(extras["pp_handoff_steps"])
    return replay_idle_steps(
        extras["pp_schedule"], m, p, v, extras["pp_op_seconds_steps"], costs, handoff_s(extras, steps)
    )


def idle_table(results: dict, steps: int = IDLE_STEPS - 2) -> dict:
    """Per configuration: each stage's idle fraction, the formula's, the replay's, and where each
    stage's time went over the measured steps (compute, blocked in recv, in isend calls; seconds)."""
    table = {}
    for name, r in results.items():
        e = r["extras"]
        table[name] = {
            "idle": [round(f, 3) for f in e["pp_idle_fraction"]],
            "formula": round(e["pp_bubble_fraction_theory"], 3),
            "replay": [round(f, 3) for f in replayed(e, steps)],
            "foreign_cpu": round(r["foreign_cpu"], 3),
            **{k: [round(s, 3) for s in e[f"pp_{k}_s"]] for k in ("step", "busy", "recv_wait", "send")},
        }
    return table


@pytest.mark.extra
@pytest.mark.slow
def test_every_stage_idles_the_schedules_bubble(tmp_path):
    """Each stage's idle share of its step (step minus its timed forward and backward calls, the
    median step after warm-up; every stage's step ends at the pipeline's flush) is within 0.05 of
    the replay: its schedule's orders played out with each measured step's own compute per op and
    chunk and the measured cost of a hand-off on every crossing (``replayed``). The textbook
    formula assumes equal chunks and free hand-offs; on a slower CPU (an AMX Xeon) interleaved
    idled 0.162 against its 0.111, and a criterion on the formula fails there for what the
    machine is, not for what the schedule does. The replay is the formula's own arithmetic
    (tests/unit/test_pipeline_parallel.py: with equal costs it is the formula) on what this
    machine measured, so what remains is the hand-offs' waits and step-to-step noise: it fails on
    idle the compute and the order do not explain (a loop that waits: receives posted late, an
    extra synchronisation). It does not tell two orders apart whose replays are alike at the
    measured costs: a planted loop running GPipe's order over interleaved's chunks passed it
    (0.247 / 0.127 measured, 0.234 / 0.102 replayed). Zero bubble (ZB-H1) idles less than 1F1B
    on every stage, and interleaved less than 1F1B on average. vit, 2 stages, m = 4
    micro-batches of 64, every chunk 4 blocks (depth 8; interleaved, 4 chunks: depth 16). The FLOP
    cut is also the time cut here to ~4% (forward + backward of a 4-block chunk ~100 ms, the embed
    4 ms, head + loss 1 ms), since the vit's tokens are contiguous (models/vit.py: strided, every
    block of the first stage was ~15% slower than a later stage's). What the formula leaves out is
    each hand-off, a fixed cost per micro-batch per chunk, which 4-block chunks make half (gpipe,
    1f1b) or a quarter (interleaved) of the share of an op it is at depth 4 (see IDLE_CONFIGS).
    The default suite keeps the formula alive with the played-out orders
    (tests/unit/test_pipeline_parallel.py test_orders_played_out_idle_the_formula) and the
    per-stage breakdown with test_each_stages_step_splits_into_compute_and_its_waits. The table
    printed has, per configuration, the share of the machine's CPUs other processes took while
    it trained (foreign_cpu): a rank sharing its core runs slower than its peer and the other
    idles by the difference. Measured pass rates (quiet and loaded machine): docs/pp.md."""
    results = run_pp_vit(IDLE_CONFIGS, tmp_path, steps=IDLE_STEPS, global_batch=256, run=IDLE_RUN)
    table = idle_table(results)
    print("idle per stage vs formula:", json.dumps(table))
    for name, row in table.items():
        assert all(abs(f - r) <= 0.05 for f, r in zip(row["idle"], row["replay"])), (name, row)
    assert statistics.mean(table["interleaved"]["idle"]) < statistics.mean(table["1f1b"]["idle"])
    assert all(z < o for z, o in zip(table["zero_bubble"]["idle"], table["1f1b"]["idle"])), table
