"""``bench bubbles``' report (parallel_lab/bench/bubbles.py measures): the table, the distances of
every run to its formula and its replays, each gap split into its parts, the verdict line and
whether zero bubble idled at most 1F1B's on every stage."""

from __future__ import annotations


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
