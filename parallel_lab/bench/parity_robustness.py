"""``python -m parallel_lab.bench parity_robustness``: the parity criterion's false-alarm rate, measured.

A parity verdict (parallel_lab/report/parity.py) must not depend on the CPU it runs on. The floats
of a CPU run come from three libraries, each choosing its own instruction set at start-up: ATen's
own kernels (``ATEN_CPU_CAPABILITY``), oneDNN for the convolutions (``ONEDNN_MAX_CPU_ISA``) and MKL
for the matrix products (``MKL_ENABLE_INSTRUCTIONS``). This bench runs every test marked
``parity`` (the real strategies' configurations the suite judges, and the deliberately broken
variants it must catch) once under every combination of those settings the CPU allows, collects
every verdict the tests make ($PARALLEL_LAB_PARITY_LOG, report/parity.py ``log_verdict``), and
prints, per configuration and dispatch, the worst of the four ratios as a fraction of the bound.

Its last line: ``false alarms: F/N real runs; broken variants caught: C/B; worst real ratio: R of
the bound; replica check: ...`` (the exact replica check alone: its false alarms over the real runs
it compared, and the broken variants whose replicas split). docs/parity.md shows a run of it. Run
from a checkout (it needs tests/): ``python -m parallel_lab.bench parity_robustness [--limit N]
[--mark EXPR] [--tests PATH ...] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parallel_lab.report.parity import ENVELOPE_MULTIPLE, VERDICT_LOG_ENV

ROOT = Path(__file__).resolve().parents[2]
ATEN = ("native", "avx2", "default")  # ATEN_CPU_CAPABILITY
ONEDNN = ("native", "AVX2", "SSE41")  # ONEDNN_MAX_CPU_ISA
MKL = ("native", "AVX2")  # MKL_ENABLE_INSTRUCTIONS
NEEDS_FLAG = {"avx2": "avx2", "AVX2": "avx2", "SSE41": "sse4_1"}  # /proc/cpuinfo flag each setting needs
TEST_TIMEOUT_S = 1500  # one pytest pass of the parity tests under one dispatch

PROBE = """
import torch
torch.nn.functional.conv2d(torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3))
torch.randn(256, 256) @ torch.randn(256, 256)
print("ATEN", torch.backends.cpu.get_cpu_capability())
"""


@dataclass(frozen=True)
class Dispatch:
    """One choice of instruction set for each of the three kernel libraries ("native": its own)."""

    aten: str
    onednn: str
    mkl: str

    def env(self) -> dict[str, str]:
        names = (("ATEN_CPU_CAPABILITY", self.aten), ("ONEDNN_MAX_CPU_ISA", self.onednn))
        return {
            **{name: value for name, value in names if value != "native"},
            **({"MKL_ENABLE_INSTRUCTIONS": self.mkl} if self.mkl != "native" else {}),
        }

    @property
    def label(self) -> str:
        return f"aten={self.aten} onednn={self.onednn} mkl={self.mkl}"


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def dispatches(flags: set[str]) -> list[Dispatch]:
    """Every combination whose settings this CPU has (a setting above the CPU would be ignored)."""
    allowed = lambda value: value not in NEEDS_FLAG or NEEDS_FLAG[value] in flags  # noqa: E731
    return [Dispatch(*combo) for combo in itertools.product(ATEN, ONEDNN, MKL) if all(map(allowed, combo))]


def probe(dispatch: Dispatch) -> dict[str, str]:
    """What each library actually chose under this dispatch (their own verbose output)."""
    env = {**os.environ, **dispatch.env(), "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    onednn = re.search(r"isa:([^,\n]+)", text)
    mkl = re.search(r"Intel\(R\) 64 architecture (.*?)(?: enabled processors| with support|,|$)", text, re.M)
    aten = re.search(r"^ATEN (\S+)", text, re.M)
    return {
        "aten": aten.group(1) if aten else "?",
        "onednn": onednn.group(1).strip() if onednn else "?",
        "mkl": re.sub(r"Intel\(R\) |\(Intel\(R\) [^)]*\)", "", mkl.group(1)).strip() if mkl else "?",
    }


def distinct(chosen: list[Dispatch]) -> list[Dispatch]:
    """The first dispatch of each distinct (ATen, oneDNN, MKL) choice the libraries report: on a CPU
    whose native paths are the forced ones (AVX2 on an AMD EPYC), several settings run the same
    kernels, and a pass per setting would only repeat a pass."""
    seen: dict[tuple, Dispatch] = {}
    for dispatch in chosen:
        seen.setdefault(tuple(probe(dispatch).values()), dispatch)
    return list(seen.values())


def run_tests(dispatch: Dispatch, log: Path, mark: str, out_dir: Path, tests: list[str]) -> int:
    """The parity tests under this dispatch; every verdict they make lands in log."""
    env = {**os.environ, **dispatch.env(), VERDICT_LOG_ENV: str(log)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", mark, "-p", "no:cacheprovider", *tests]
    with open(out_dir / f"{log.stem}.pytest.txt", "w") as output:
        try:
            return subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=TEST_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            return -1


def read_verdicts(log: Path) -> list[dict]:
    """Rank 0's verdicts (the other ranks of a distributed body judge the same run again)."""
    if not log.exists():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r for r in records if r["rank"] == 0]


def configuration(record: dict) -> str:
    """``test_file::test_name[id] label``: the test's file without its folder (tests/integration/...)."""
    path, _, test = record["test"].partition("::")
    name = f"{Path(path).stem}::{test}" if test else path
    return f"{name} {record['label']}".strip()


def bound_fraction(record: dict) -> float:
    """The worst of the verdict's ratios, as a fraction of the pass bound (1.0 = on the bound)."""
    return max(record["ratios"].values()) / ENVELOPE_MULTIPLE


def cell(records: list[dict]) -> str:
    if not records:
        return "–"
    worst = max(map(bound_fraction, records))
    if records[0]["expect_pass"]:
        return f"{worst:.2f}" + ("" if all(r["passed"] for r in records) else " FALSE ALARM")
    return f"caught {worst:.0f}" if not any(r["passed"] for r in records) else f"MISSED {worst:.2f}"


def table(results: list[tuple[Dispatch, dict, int, list[dict]]]) -> str:
    """Configuration x dispatch: the worst ratio as a fraction of the bound (broken: 'caught')."""
    lines = [
        f"D{i + 1}: {d.label} -> ATen {p['aten']}, oneDNN {p['onednn']}, MKL {p['mkl']}; pytest exit {code}"
        for i, (d, p, code, _) in enumerate(results)
    ]
    by_config: dict[str, dict[int, list[dict]]] = {}
    for i, (_, _, _, records) in enumerate(results):
        for record in records:
            by_config.setdefault(configuration(record), {}).setdefault(i, []).append(record)
    header = ["configuration", *(f"D{i + 1}" for i in range(len(results)))]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in sorted(by_config):
        lines.append("| " + " | ".join([name, *(cell(by_config[name].get(i, [])) for i in range(len(results)))]) + " |")
    return "\n".join(lines)


def by_test(results: list[tuple[Dispatch, dict, int, list[dict]]]) -> str:
    """Per test function (real and broken kept apart): the worst fraction of the bound per dispatch
    for real runs, the lowest for broken ones ('caught x' / MISSED); how many configurations each judged."""
    groups: dict[tuple[str, bool], dict[int, list[dict]]] = {}
    for i, (*_, records) in enumerate(results):
        for record in records:
            test = re.sub(r"\[.*\]", "", record["test"].rsplit("::", 1)[-1])
            groups.setdefault((test, record["expect_pass"]), {}).setdefault(i, []).append(record)
    header = ["test (configurations)", *(f"D{i + 1}" for i in range(len(results)))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (test, real), cells in sorted(groups.items()):
        count = max(map(len, cells.values()))
        row = [f"{test} ({count})" if real else f"broken: {test} ({count})"]
        for i in range(len(results)):
            records = cells.get(i, [])
            if not records:
                row.append("–")
            elif real:
                worst = max(map(bound_fraction, records))
                row.append(f"{worst:.2f}" + ("" if all(r["passed"] for r in records) else " FALSE ALARM"))
            else:
                lowest = min(map(bound_fraction, records))
                row.append("MISSED" if any(r["passed"] for r in records) else f"caught {lowest:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def replica_line(records: list[dict]) -> str:
    """The replica check alone (exact, no envelope), over the verdicts that carried it (agree not
    None): real runs whose replicas differed, broken variants whose replicas differed."""
    compared = [r for r in records if r.get("replicas_agree") is not None]
    real = [r for r in compared if r["expect_pass"]]
    broken = [r for r in compared if not r["expect_pass"]]
    return (
        f"replica check: false alarms {sum(r['replicas_agree'] is False for r in real)}/{len(real)} real runs; "
        f"broken variants split: {sum(r['replicas_agree'] is False for r in broken)}/{len(broken)}"
    )


def summary_line(records: list[dict]) -> str:
    real = [r for r in records if r["expect_pass"]]
    broken = [r for r in records if not r["expect_pass"]]
    false_alarms = sum(not r["passed"] for r in real)
    caught = sum(not r["passed"] for r in broken)
    worst = max(map(bound_fraction, real), default=float("nan"))
    return (
        f"false alarms: {false_alarms}/{len(real)} real runs; broken variants caught: {caught}/{len(broken)}; "
        f"worst real ratio: {worst:.2f} of the bound; {replica_line(records)}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench parity_robustness", description=__doc__)
    parser.add_argument("--limit", type=int, default=0, help="run only the first N dispatches (0: all)")
    parser.add_argument(
        "--mark",
        default="parity and (not extra or robustness)",
        help="pytest -m expression (default: make test's parity tests and SGD's pair from make test-all)",
    )
    parser.add_argument(
        "--distinct", action="store_true", help="one dispatch per distinct choice the libraries report (probe)"
    )
    parser.add_argument(
        "--tests", nargs="+", default=["tests"], help="pytest paths or node ids to run (default: tests)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the logs (default runs/parity_robustness/<time>)"
    )
    args = parser.parse_args(argv)
    if not (ROOT / "tests").is_dir():
        print(
            f"parity_robustness runs the parity tests: no tests/ in {ROOT}; run it from a checkout of the project",
            file=sys.stderr,
        )
        return 2
    out_dir = args.out or ROOT / "runs" / "parity_robustness" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = dispatches(cpu_flags())
    if args.distinct:
        chosen = distinct(chosen)
        print(f"{len(chosen)} distinct dispatches: " + "; ".join(d.label for d in chosen), flush=True)
    chosen = chosen[: args.limit or None]
    results = []
    for i, dispatch in enumerate(chosen):
        start = time.monotonic()
        log = out_dir / f"D{i + 1}.jsonl"
        seen = probe(dispatch)
        code = run_tests(dispatch, log, args.mark, out_dir, args.tests)
        records = read_verdicts(log)
        results.append((dispatch, seen, code, records))
        print(
            f"D{i + 1}/{len(chosen)} {dispatch.label}: {len(records)} verdicts, pytest exit {code}, "
            f"{time.monotonic() - start:.0f} s; {summary_line(records)}",
            flush=True,
        )
    report = table(results) + "\n\n" + by_test(results)
    all_records = [r for *_, records in results for r in records]
    (out_dir / "parity_robustness.md").write_text(report + "\n\n" + summary_line(all_records) + "\n")
    print(report)
    print(summary_line(all_records))
    return 0
