"""``python -m parallel_lab.bench bubbles [--p 2[,4]] [--m 2,4,8] [--micro-batch 32] [--steps 6]``

Pipeline bubbles measured: the vit (depth 8, equal blocks) cut into stages balanced by measured
time (``strategy.balance=time``: every block timed once here, in the parent, as its stage runs it --
zero bubble's B and W, the embedding, the head with the loss; pp/timing.py) on p real gloo ranks,
trained through the real loop for every schedule of the manual loop -- gpipe, 1f1b,
interleaved_1f1b with v = 2 and zero_bubble (ZB-H1, one chunk per rank: backward split into input-
and weight-gradient passes) -- at m micro-batches. Each stage's measured idle share of its step (metrics.json's
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

SCHEDULES = {  # label -> strategy.* overrides
    "gpipe": ["schedule=gpipe"],
    "1f1b": ["schedule=1f1b"],
    "interleaved_1f1b v=2": ["schedule=interleaved_1f1b", "virtual_stages=2"],
    "zero_bubble": ["schedule=zero_bubble"],  # ZB-H1 in the manual loop (pp/zero_bubble.py)
}
RUN = ["model=vit", "model.depth=8", "trainer.eval_batches=0", "trainer.warmup_steps=2", "trainer.threads_per_rank=1"]
TIME_REPEATS = 15  # the bench's block timing: a median of 15 (balance=time's default 5 moves the cut under load)


def pipeline_name() -> str:
    """The pipeline strategy's registered name (strategy=<name>)."""
    from parallel_lab.strategies import get_strategy_class, registered_names
    from parallel_lab.strategies.pp.strategy import PipelineParallelStrategy

    return next(n for n in registered_names() if get_strategy_class(n) is PipelineParallelStrategy)


def configs(
    p: int, ms: list[int], micro_batch: int, times: dict[bool, list[float]] | None = None
) -> dict[str, list[str]]:
    """'schedule, m' -> the overrides of that run (the interleaved schedules need m a multiple of p).
    ``times``: per backward kind (split in B and W or not) the measured block times every run of
    that kind cuts by (``block_times``), so every schedule of a kind has the same cut; None: the
    ranks' default balance (FLOPs)."""
    out = {}
    for m in ms:
        for label, options in SCHEDULES.items():
            if "virtual_stages=2" in options and m % p:
                continue
            overrides = [f"strategy={pipeline_name()}", f"strategy.stages={p}", f"strategy.microbatches={m}"]
            if times is not None:
                given = ",".join(repr(t) for t in times["schedule=zero_bubble" in options])
                overrides += ["strategy.balance=time", f"strategy.block_times=[{given}]"]
            out[f"{label}|{m}"] = [*overrides, *(f"strategy.{o}" for o in options), *RUN]
    return out


def block_times(p: int, micro_batch: int, repeats: int = TIME_REPEATS) -> dict[bool, list[float]]:
    """Each block's seconds as its stage runs it (pp/timing.py), measured here, in the parent,
    before any rank starts: one backward pass (gpipe, 1f1b, interleaved) and B + W (zero bubble)."""
    from parallel_lab import config
    from parallel_lab.strategies.pp.timing import measure_block_times

    out = {}
    for split, schedule in ((False, "1f1b"), (True, "zero_bubble")):
        overrides = [f"strategy={pipeline_name()}", f"strategy.stages={p}", "strategy.microbatches=1"]
        cfg = config.compose_config(
            [*overrides, f"strategy.schedule={schedule}", f"trainer.global_batch={micro_batch}", *RUN]
        )
        out[split] = measure_block_times(cfg, repeats)
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

    p, m, v = extras["pp_stages"], extras["pp_microbatches"], extras["pp_virtual_stages"]
    costs = extras["pp_handoff_steps"] if handoffs else compute_only(extras["pp_handoff_steps"])
    return replay_idle_steps(extras["pp_schedule"], m, p, v, extras["pp_op_seconds_steps"], costs)


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


def _gap(row: dict, key: str) -> float:
    ref = row[key] if isinstance(row[key], list) else [row[key]] * len(row["idle"])
    return max(abs(f - r) for f, r in zip(row["idle"], ref))


def _formula(row: dict) -> float:
    """The formula a run is judged by: zero bubble's at its measured passes, else the schedule's."""
    return row.get("passes", row["theory"])


def _formula_gap(row: dict, idle: str = "idle") -> float:
    """The largest |stage idle − the run's formula| (``idle``: measured, or ``replay`` of compute)."""
    return max(abs(i - _formula(row)) for i in row[idle])


def last_line(rows: list[dict]) -> str:
    """The stage farthest from its formula, and from its replay, over every run."""
    lines = []
    for key, name in (("passes", "formula"), ("replay", "replay"), ("replay_handoffs", "replay with hand-offs")):
        gap = _formula_gap if key == "passes" else (lambda r: _gap(r, key))
        worst = max(rows, key=gap)
        where = f"({worst['schedule']}, p={worst['p']}, m={worst['m']})"
        lines.append(f"max |measured − {name}| idle fraction: {gap(worst):.3f} {where}")
    return "\n".join(lines)


GOAL = 0.05  # issue 47: measured idle within 0.05 of the formula on a quiet machine
BALANCED = 0.02  # the formula's assumptions held: the replay of compute within this of it, every stage


def _worst_stage(rows: list[dict]) -> tuple[dict, int]:
    """The run and stage whose measured idle is farthest from its formula."""
    pairs = [(r, s) for r in rows for s in range(len(r["idle"]))]
    return max(pairs, key=lambda rs: abs(rs[0]["idle"][rs[1]] - _formula(rs[0])))


def gap_parts(row: dict, s: int) -> tuple[float, float, float, float]:
    """Stage s's measured − equal-pass formula, in four parts that add up to it: the unequal
    passes (zero bubble's formula at its measured F, B, W − at equal ones; 0 for the others), the
    chunks' uneven compute (replay of compute − that formula), the hand-offs (replay with
    hand-offs − replay of compute) and what remains (measured − replay with hand-offs)."""
    return (
        _formula(row) - row["theory"],
        row["replay"][s] - _formula(row),
        row["replay_handoffs"][s] - row["replay"][s],
        row["idle"][s] - row["replay_handoffs"][s],
    )


def _where(row: dict, s: int | None = None) -> str:
    return f"({row['schedule']}, p={row['p']}, m={row['m']}{'' if s is None else f', stage {s}'})"


def _split(parts: tuple[float, float, float, float]) -> str:
    passes, compute, hand, rest = parts
    lead = f"unequal passes {passes:+.3f} + " if passes else ""
    return f"{lead}uneven compute {compute:+.3f} + hand-offs {hand:+.3f} + rest {rest:+.3f}"


def by_schedule(rows: list[dict]) -> str:
    """Per schedule: its stage farthest from its formula over every p and m, measured vs formula vs
    the replay with hand-offs, the gap split (``gap_parts``), and whether every stage at every m is
    within GOAL of the formula and of the replay."""
    lines = []
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == schedule]
        row, s = _worst_stage(mine)
        formula = max(_formula_gap(r) for r in mine)
        replay = max(_gap(r, "replay_handoffs") for r in mine)
        equal = f" (equal passes {row['theory']:.3f})" if _formula(row) != row["theory"] else ""
        lines.append(
            f"{schedule}: measured {row['idle'][s]:.3f} vs formula {_formula(row):.3f}{equal} vs replay "
            f"{row['replay_handoffs'][s]:.3f} (p={row['p']}, m={row['m']}, stage {s}): gap "
            f"{row['idle'][s] - row['theory']:+.3f} = {_split(gap_parts(row, s))}; max |measured − formula| "
            f"{formula:.3f} ({'within' if formula <= GOAL else 'over'} {GOAL}), max |measured − replay with "
            f"hand-offs| {replay:.3f}"
        )
    return "\n".join(lines)


def judged(row: dict) -> tuple[str, float]:
    """What a run is judged by, and its largest distance to it: the formula where every stage's
    replay of compute is within BALANCED of it (the run's compute was what the formula assumes:
    chunks alike, each op's time the same all step), else the replay with hand-offs (the stages'
    compute differed, or an op ran faster while its neighbour idled: what the formula cannot know)."""
    if _formula_gap(row, "replay") <= BALANCED:
        return "formula", _formula_gap(row)
    return "replay", _gap(row, "replay_handoffs")


def verdict(rows: list[dict]) -> str:
    """The bench's last line: the largest distance to the formula and to the replay with
    hand-offs, what the hand-offs (and uneven compute) make of the first, the schedules over GOAL,
    and each run judged (``judged``)."""
    row, s = _worst_stage(rows)
    passes, compute, hand, rest = gap_parts(row, s)
    worst = max(rows, key=lambda r: _gap(r, "replay_handoffs"))
    over = sorted({r["schedule"] for r in rows if _formula_gap(r) > GOAL})
    verdicts = [(r, *judged(r)) for r in rows]
    failed = [f"{r['schedule']} m={r['m']} by the {by} {gap:.3f}" for r, by, gap in verdicts if gap > GOAL]
    by_replay = sum(by == "replay" for _, by, _ in verdicts)
    return (
        f"max |measured − formula| idle: {abs(row['idle'][s] - _formula(row)):.3f} {_where(row, s)}; "
        f"max |measured − replay with hand-offs|: {_gap(worst, 'replay_handoffs'):.3f} {_where(worst)}; "
        f"hand-offs explain {hand:+.3f} of that gap (uneven compute {compute:+.3f}, rest {rest:+.3f}); "
        f"formula within {GOAL}: " + ("every schedule" if not over else "not " + ", ".join(over)) + "; "
        f"judged (the formula where the replay of compute is within {BALANCED} of it, else the replay with "
        f"hand-offs: {by_replay} of {len(rows)} runs): "
        + ("every run within" if not failed else "over: " + ", ".join(failed))
    )


def zero_bubble_vs_1f1b(rows: list[dict]) -> str:
    """Whether every stage of zero bubble idled at most 1F1B's at the same p and m."""
    idle = {(r["schedule"], r["p"], r["m"]): r["idle"] for r in rows}
    pairs = [(k, idle[("1f1b", *k[1:])]) for k in idle if k[0] == "zero_bubble" and ("1f1b", *k[1:]) in idle]
    worse = [f"p={k[1]} m={k[2]}" for k, ref in pairs if any(z > o for z, o in zip(idle[k], ref))]
    return "zero bubble idles at most 1F1B's on every stage: " + ("yes" if not worse else "no at " + ", ".join(worse))


def render(rows: list[dict]) -> str:
    lines = [
        "| schedule | p | m | formula | formula at measured passes (F / B / W ms) | compute per step (s) "
        "| replay of measured compute | replay with measured hand-offs "
        "| measured idle | hand-off latency / op overhead (ms) | max |measured − formula| "
        "| max |measured − replay with hand-offs| | judged by | load avg 1 min (before / after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        idle, replay, handoffs = (" / ".join(f"{f:.3f}" for f in r[k]) for k in ("idle", "replay", "replay_handoffs"))
        cost = " / ".join(f"{1e3 * lat:.1f}, {1e3 * op:.1f}" for lat, op in zip(*r["handoff"]))
        load = " / ".join(f"{x:.1f}" for x in r["load"])
        passes = " / ".join(f"{1e3 * t:.1f}" for t in r.get("pass_s", {}).values())
        compute = " / ".join(f"{t:.2f}" for t in r.get("compute_s", []))
        by, _ = judged(r)
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['theory']:.3f} | {_formula(r):.3f} ({passes}) | {compute} "
            f"| {replay} | {handoffs} | {idle} | {cost} | {_formula_gap(r):.3f} "
            f"| {_gap(r, 'replay_handoffs'):.3f} | {by} | {load} |"
        )
    return "\n".join(lines)


NOTE = """
Formula: (p-1)/(m+p-1) gpipe and 1f1b (arXiv 1811.06965), (p-1)/(vm+p-1) interleaved (Narayanan et
al., arXiv 2104.04473), (p-1)/(3m+p-1) zero bubble (ZB-H1, Qi et al., arXiv 2401.10241: F, B, W
equal); each assumes equal chunks and free hand-offs. Formula at measured passes: zero bubble's
at the run's mean F, B and W per micro-batch and chunk (schedules.zero_bubble_fraction; for
W <= F <= B Qi et al.'s (p-1)(F+B-W) over m(F+B+W)): here B > W (norms, softmax and GELU backward
stay in B), so no order of the W passes fills what (p-1)/(3m+p-1) promises; the other schedules'
formulas do not depend on the passes. Compute per step: each stage's measured compute (the cut:
balance=time, each block timed in the parent as its stage runs it). Judged by: the formula where
every stage's replay of compute is within 0.02 of it (the compute was what the formula assumes),
else the replay with hand-offs (the stages' compute differed in the run, or ops ran faster while
the neighbour idled: what no cut made beforehand controls).
Replay of measured compute: the schedule's
orders played out (schedules.play) with each op's own measured compute in each measured step, the
median step's: the bubble of these chunks, whose passes are not equal and not constant (an op
computing while its neighbour idles runs faster than beside it). Replay with measured hand-offs:
the same plus what each hand-off cost in the run (pp_handoff_steps, pp/handoffs.py): per op the
time on the stage outside its compute and its waits (posting receives, the isend call: the
latency / op overhead column's second figure, ms), a crossing's latency from the producer's compute
end to the receiver's recv returning (its first figure, ms: the stage's mean over the crossings it
waited for), each stage's start and the flush barrier. replay with hand-offs − replay of compute
is what the hand-offs add; measured − replay with hand-offs is what remains: the spread of the
latency (the replay takes each stage's mean, and a wait is max(0, latency − slack), so a latency
that varies from 0.5 to 20 ms waits more than its mean does) and the steps' noise. Small m has
long bubbles and few ops (close to the formula); large m and interleaved chunks have many short
ops, whose hand-off costs weigh more. Idle: each stage's step minus its timed compute, over its
step, the median of the steps after warm-up. Noise: this machine has 2 cores shared with other
work (the load averages above): every hand-off waits for the receiving process to be scheduled.
The formulas themselves are exact in tests/unit/test_pipeline_parallel.py (the orders played
out); the replay with hand-offs against a timeline worked by hand in tests/unit/test_pp_handoffs.py."""


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
        rows += measure(p, ms, args.micro_batch, args.steps, times)
    print()
    print(render(rows))
    print(NOTE)
    print(zero_bubble_vs_1f1b(rows))
    print(last_line(rows))
    print("\nper schedule, its stage farthest from the formula (gap = passes + compute + hand-offs + rest):")
    print(by_schedule(rows))
    print(verdict(rows))
    return 0
