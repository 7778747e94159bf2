"""bench parity_robustness's own arithmetic (parallel_lab/bench/parity_robustness.py): the replica
check's false alarms and splits counted apart from the envelope's, and --distinct keeping one
dispatch per choice the libraries report. The bench itself runs the parity tests: docs/parity.md."""

from __future__ import annotations

from parallel_lab.bench import parity_robustness as bench


def _record(expect_pass: bool, passed: bool, agree: bool | None) -> dict:
    return {"expect_pass": expect_pass, "passed": passed, "replicas_agree": agree, "ratios": {"early_dloss": 1.0}}


def test_the_replica_line_counts_only_the_verdicts_that_compared_replicas():
    records = [
        _record(True, True, True),
        _record(True, False, False),  # a real run whose replicas split: the replica check's false alarm
        _record(True, True, None),  # nothing held twice: not counted
        _record(False, False, False),  # a broken variant the replica check caught
        _record(False, False, True),  # one it cannot see (a data bug): the envelope caught it
    ]
    assert bench.replica_line(records) == "replica check: false alarms 1/2 real runs; broken variants split: 1/2"
    assert bench.summary_line(records).endswith(bench.replica_line(records))


def test_distinct_keeps_the_first_dispatch_of_each_reported_choice(monkeypatch):
    chosen = bench.dispatches({"avx2", "sse4_1"})
    assert len(chosen) == 18  # every setting allowed on an AVX2 CPU
    # what an AVX2 CPU reports: native and AVX2 run the same kernels; MKL names no instruction set
    seen = lambda d: {"aten": "DEFAULT" if d.aten == "default" else "AVX2", "onednn": d.onednn == "SSE41"}  # noqa: E731
    monkeypatch.setattr(bench, "probe", seen)
    kept = bench.distinct(chosen)
    assert [d.label for d in kept] == [
        "aten=native onednn=native mkl=native",
        "aten=native onednn=SSE41 mkl=native",
        "aten=default onednn=native mkl=native",
        "aten=default onednn=SSE41 mkl=native",
    ]
