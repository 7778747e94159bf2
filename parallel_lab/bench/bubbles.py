"""``python -m parallel_lab.bench bubbles [--p 2[,4]] [--m 2,4,8] [--micro-batch 32] [--steps 6]``

Pipeline bubbles measured: the vit (depth 8, equal blocks) cut into stages balanced by measured
time (``strategy.balance=time``: every block timed once here, in the parent, as its stage runs it --
zero bubble's B and W, the embedding, the head with the loss; pp/timing.py) on p real gloo ranks,
trained through the real loop for every schedule of the manual loop -- gpipe, 1f1b,
interleaved_1f1b with v = 2 and zero_bubble (one chunk per rank, backward split into input- and
weight-gradient passes, its order built from the parent's per-stage F, B, W: pp/zb_orders.py) --
at m micro-batches. Each stage's measured idle share of its step (metrics.json's
``pp_idle_fraction``: step minus the stage's timed forward and backward calls, the median step
after warm-up; docs/pp.md "Idle: how it is measured") beside the formula (``pp_bubble_fraction_theory``):
(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved, (p-1)/(3m+p-1) zero bubble, which
assumes F = B = W: its formula at the run's own mean F, B and W passes (Qi et al.'s (p-1)(F+B-W)
over m(F+B+W), schedules.zero_bubble_fraction) is what zero bubble is judged by; and
beside both two replays: the orders played out with each op's own measured compute (the bubble
of these unequal chunks, hand-offs free), and with the hand-offs' measured costs too (posting
receives, isend calls, each crossing's latency: ``pp_handoff_steps``, pp/handoffs.py). What the
second leaves of the measured idle is printed per run.

Default: p = 2, m = 2, 4, 8, 6 steps (2 warm-up) of micro-batches of 32: about 2-4 minutes on the
2-core machine. p = 4 (``--p 2,4``) puts 4 processes on 2 cores: slower and noisier still. The
machine's load average is printed with every run: this is a shared machine, every hand-off waits
for the receiving process to be scheduled, and the numbers are as noisy as that load makes them.
The last lines: whether zero bubble idled at most 1F1B's on every stage; the largest distance
between a stage's measured idle share and the formula, the replay of compute, and the replay of
compute and hand-offs; per schedule, its stage farthest from the formula with that gap split into
unequal passes (zero bubble), the chunks' uneven compute, the hand-offs and the rest, and whether
it is within 0.05; and the verdict line: ``max |measured − formula| idle: X (where); max |measured
− replay with hand-offs|: Y (where); hand-offs explain Z of that gap (...); formula within 0.05:
...; judged ...``: each run by the formula where the run's compute held the formula's assumptions
(its replay of compute within BALANCED of the formula: chunks alike, each op's time constant),
else by the replay with hand-offs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from parallel_lab.bench._bubbles_verdict import (  # noqa: F401  (the report: re-exported for the tests)
    BALANCED,
    GOAL,
    NOTE,
    by_schedule,
    gap_parts,
    judged,
    last_line,
    render,
    verdict,
    zero_bubble_vs_1f1b,
)

SCHEDULES = {  # label -> strategy.* overrides
    "gpipe": ["schedule=gpipe"],
    "1f1b": ["schedule=1f1b"],
    "interleaved_1f1b v=2": ["schedule=interleaved_1f1b", "virtual_stages=2"],
    "zero_bubble": ["schedule=zero_bubble"],  # the manual loop: order built from the passes (pp/zb_orders.py)
}
RUN = ["model=vit", "model.depth=8", "trainer.eval_batches=0", "trainer.warmup_steps=2", "trainer.threads_per_rank=1"]
TIME_REPEATS = 15  # the bench's block timing: a median of 15 (balance=time's default 5 moves the cut under load)


def pipeline_name() -> str:
    """The pipeline strategy's registered name (strategy=<name>)."""
    from parallel_lab.strategies import get_strategy_class, registered_names
    from parallel_lab.strategies.pp.strategy import PipelineParallelStrategy

    return next(n for n in registered_names() if get_strategy_class(n) is PipelineParallelStrategy)


def configs(p: int, ms: list[int], micro_batch: int, times: dict | None = None) -> dict[str, list[str]]:
    """'schedule, m' -> the overrides of that run (the interleaved schedules need m a multiple of p).
    ``times``: per backward kind (split in B and W or not) the measured block times every run of
    that kind cuts by (``block_times``), so every schedule of a kind has the same cut, and under
    "passes" zero bubble's per-block F, B, W its order is built from (``pass_times``,
    pp/zb_orders.py); None: the ranks' default balance (FLOPs)."""
    out = {}
    for m in ms:
        for label, options in SCHEDULES.items():
            if "virtual_stages=2" in options and m % p:
                continue
            overrides = [f"strategy={pipeline_name()}", f"strategy.stages={p}", f"strategy.microbatches={m}"]
            if times is not None:
                given = ",".join(repr(t) for t in times["schedule=zero_bubble" in options])
                overrides += ["strategy.balance=time", f"strategy.block_times=[{given}]"]
                if "schedule=zero_bubble" in options and times.get("passes"):
                    rows = ",".join("[" + ",".join(repr(t) for t in row) + "]" for row in times["passes"])
                    overrides.append(f"strategy.pass_times=[{rows}]")
            out[f"{label}|{m}"] = [*overrides, *(f"strategy.{o}" for o in options), *RUN]
    return out


def block_times(p: int, micro_batch: int, repeats: int = TIME_REPEATS) -> dict:
    """Each block's seconds as its stage runs it (pp/timing.py), measured here, in the parent,
    before any rank starts: one backward pass (gpipe, 1f1b, interleaved: key False) and B + W
    (zero bubble: True; "passes": its F, B, W apart, from the same passes)."""
    from parallel_lab import config
    from parallel_lab.strategies.pp.timing import measure_pass_times

    out = {}
    for split, schedule in ((False, "1f1b"), (True, "zero_bubble")):
        overrides = [f"strategy={pipeline_name()}", f"strategy.stages={p}", "strategy.microbatches=1"]
        cfg = config.compose_config(
            [*overrides, f"strategy.schedule={schedule}", f"trainer.global_batch={micro_batch}", *RUN]
        )
        out[split], passes = measure_pass_times(cfg, repeats)
        if split:
            out["passes"] = passes
    return out


def bubbles_body(rank: int, world_size: int, runs: dict, steps: int, micro_batch: int) -> None:
    """run_ranks' body: train each run in turn; rank 0 prints one JSON line per run."""
    import torch.distributed as dist

    from parallel_lab import config
    from parallel_lab.comm.dist_env import read_dist_env
    from parallel_lab.strategies import get_strategy_class
    from parallel_lab.worker.train import train

    env = read_dist_env("cpu")
    for key, overrides in runs.items():
        m = int(key.rsplit("|", 1)[1])
        load = os.getloadavg()[0]
        cfg = config.validate(
            config.compose_config(
                [
                    "trainer.progress=false",
                    f"world_size={world_size}",
                    f"trainer.steps={steps}",
                    f"trainer.global_batch={m * micro_batch}",
                    f"data.size={max(512, steps * m * micro_batch)}",
                    *overrides,
                ]
            )
        )
        strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
        extras = train(cfg, env, strategy).strategy_extras
        strategy.teardown()
        dist.barrier()
        if rank == 0:
            idle, theory = extras["pp_idle_fraction"], extras["pp_bubble_fraction_theory"]
            row = {"run": key, "idle": idle, "theory": theory, "replay": replay_of(extras)}
            row["replay_handoffs"] = replay_of(extras, handoffs=True)
            if extras["pp_schedule"] == "zero_bubble" and extras["pp_virtual_stages"] == 1:
                row["replay_1f1b_order"] = replay_as_1f1b(extras)
            row["handoff"] = [extras[f"pp_handoff_{k}"] for k in ("latency_s", "op_overhead_s")]
            row["passes"], row["pass_s"] = pass_formula(extras)
            row["compute_s"] = [m * sum(ops.values()) for ops in extras["pp_op_seconds"]]
            row["cut"] = [len(layers) for layers in extras["pp_stage_layers"]]
            row["load"] = [load, os.getloadavg()[0]]
            print(json.dumps(row))


def pass_formula(extras: dict) -> tuple[float, dict[str, float]]:
    """The run's formula at its own mean pass costs (seconds of one micro-batch's F, B, W through
    a chunk, averaged over the stages: ``pp_op_seconds``), and those means. Only zero bubble's
    formula depends on them (schedules.zero_bubble_fraction: Qi et al.'s (p-1)(F+B-W) over
    m(F+B+W)); GPipe's, 1F1B's and interleaved's idle is the same share whatever F and B cost."""
    from parallel_lab.strategies.pp.schedules import zero_bubble_fraction

    ops = [(k[0], s) for rank in extras["pp_op_seconds"] for k, s in rank.items()]
    mean = {op: statistics.mean(s for o, s in ops if o == op) for op in dict.fromkeys(o for o, _ in ops)}
    p, m, v = extras["pp_stages"], extras["pp_microbatches"], extras["pp_virtual_stages"]
    if extras["pp_schedule"] != "zero_bubble" or v != 1:
        return extras["pp_bubble_fraction_theory"], mean
    return zero_bubble_fraction(m, p, mean["F"], mean["B"], mean["W"]), mean


def replay_of(extras: dict, handoffs: bool = False) -> list[float]:
    """Each stage's idle in the step its order takes with the run's own measured compute per op
    (``pp_op_seconds_steps``) and, with ``handoffs``, its measured hand-off costs
    (``pp_handoff_steps``: posting receives, isend calls, each crossing's latency; pp/handoffs.py),
    else none (schedules.replay_idle_steps)."""
    from parallel_lab.strategies.pp.handoffs import compute_only
    from parallel_lab.strategies.pp.schedules import replay_idle_steps
    from parallel_lab.strategies.pp.zb_orders import built_orders

    p, m, v = extras["pp_stages"], extras["pp_microbatches"], extras["pp_virtual_stages"]
    costs = extras["pp_handoff_steps"] if handoffs else compute_only(extras["pp_handoff_steps"])
    passes = extras.get("pp_stage_passes_s")  # zero bubble's order built from them: the loop's order
    orders = built_orders(m, p, passes) if passes else None
    return replay_idle_steps(extras["pp_schedule"], m, p, v, extras["pp_op_seconds_steps"], costs, orders=orders)


def planned_orders(p: int, ms: list[int], times: dict) -> str:
    """Zero bubble's built order against ZB-H1's and 1F1B's at the parent's measured passes, each
    stage's (F, B, W) summed over its blocks of the time cut (pp/zb_orders.py): the played idle per
    stage, what the run's order was chosen by."""
    from parallel_lab.strategies.pp.plan import balanced_cuts
    from parallel_lab.strategies.pp.schedules import play, rank_orders
    from parallel_lab.strategies.pp.zb_orders import built_orders

    bounds = (0, *balanced_cuts(times[True], p), len(times[True]))
    passes = [[sum(t[k] for t in times["passes"][a:e]) for k in range(3)] for a, e in zip(bounds, bounds[1:])]
    f, b, w = ([x[k] for x in passes] for k in range(3))
    lines = ["stage passes (F / B / W ms): " + "; ".join(" / ".join(f"{1e3 * t:.1f}" for t in x) for x in passes)]
    for m in ms:
        played = {
            "built": play(built_orders(m, p, passes), f, b, w),
            "ZB-H1": play(rank_orders("zero_bubble", m, p, 1), f, b, w),
            "1F1B": play(rank_orders("1f1b", m, p, 1), f, [x + y for x, y in zip(b, w)]),
        }
        idle = {k: " / ".join(f"{(step - t) / step:.3f}" for t in busy) for k, (step, busy) in played.items()}
        lines.append(f"m={m}: played idle per stage " + ", ".join(f"{k} {v}" for k, v in idle.items()))
    return "\n".join(lines)


def replay_as_1f1b(extras: dict) -> list[float]:
    """A zero bubble run's compute replayed in 1F1B's order (each B and its W one backward, each
    op's own measured compute, hand-offs free): beside the run's own replay of compute, what its
    order gained over 1F1B's at the same compute, whatever the other runs computed."""
    from parallel_lab.strategies.pp.handoffs import compute_only
    from parallel_lab.strategies.pp.schedules import replay_idle_steps

    def merged(compute: dict[str, float]) -> dict[str, float]:
        out = {k: s for k, s in compute.items() if not k.startswith("W")}
        for key, s in compute.items():
            if key.startswith("W"):
                out["B" + key[1:]] = out.get("B" + key[1:], 0.0) + s
        return out

    p, m = extras["pp_stages"], extras["pp_microbatches"]
    ops = [[merged(step) for step in rank] for rank in extras["pp_op_seconds_steps"]]
    steps = compute_only(extras["pp_handoff_steps"])
    costs = [[{**c, "compute": merged(c["compute"])} for c in rank] for rank in steps]
    return replay_idle_steps("1f1b", m, p, 1, ops, costs)


def cut(times: list[float], p: int) -> str:
    """Where balance=time cuts these block times into p stages, and each stage's sum (ms)."""
    from parallel_lab.strategies.pp.plan import balanced_cuts

    bounds = (0, *balanced_cuts(times, p), len(times))
    sums = " / ".join(f"{1e3 * sum(times[a:b]):.0f}" for a, b in zip(bounds, bounds[1:]))
    return f"stages start at blocks {list(bounds[:-1])}, {sums} ms"


def measure(
    p: int, ms: list[int], micro_batch: int, steps: int, times: dict[bool, list[float]] | None = None
) -> list[dict]:
    """Every run at p stages, cut by ``times`` (``block_times``; None: measured here first)."""
    from parallel_lab.cli.run import run_ranks

    runs = configs(p, ms, micro_batch, times if times is not None else block_times(p, micro_batch))
    out = run_ranks(bubbles_body, p, timeout=600 + 60 * len(runs), runs=runs, steps=steps, micro_batch=micro_batch)
    rows = [json.loads(line) for line in out[0].splitlines() if line.startswith('{"run"')]
    for row in rows:
        row["schedule"], m = row.pop("run").rsplit("|", 1)
        row["p"], row["m"] = p, int(m)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench bubbles", description=__doc__.splitlines()[0])
    parser.add_argument("--p", default="2", help="pipeline stages, comma-separated (4: four processes on 2 cores)")
    parser.add_argument("--m", default="2,4,8", help="micro-batches per step, comma-separated")
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (2 warm-up)")
    args = parser.parse_args(argv)
    ms = [int(m) for m in args.m.split(",")]
    print(f"vit depth 8 (dim 64), balance=time, micro-batch {args.micro_batch}, {args.steps} steps per run")
    print(f"machine load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    rows = []
    for p in (int(p) for p in args.p.split(",")):
        times = block_times(p, args.micro_batch)
        for split, label in ((False, "one backward"), (True, "zero bubble's B + W")):
            ms_each = ", ".join(f"{1e3 * t:.1f}" for t in times[split])
            print(f"block times ({label}, ms): {ms_each}; {cut(times[split], p)}")
        print("zero bubble's order at the parent's passes:", planned_orders(p, ms, times))
        rows += measure(p, ms, args.micro_batch, args.steps, times)
    print()
    print(render(rows))
    print(NOTE)
    print(zero_bubble_vs_1f1b(rows))
    for r in (r for r in rows if "replay_1f1b_order" in r):
        replays = " vs ".join(" / ".join(f"{f:.3f}" for f in r[k]) for k in ("replay", "replay_1f1b_order"))
        print(f"zero bubble m={r['m']}: its order vs 1F1B's at its own measured compute, replayed: {replays}")
    print(last_line(rows))
    print("\nper schedule, its stage farthest from the formula (gap = passes + compute + hand-offs + rest):")
    print(by_schedule(rows))
    print(verdict(rows))
    return 0
