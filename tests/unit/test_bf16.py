"""bf16 rows in the report, in-process: a bf16 row is judged against the bf16 baseline, never the
fp32 one. The bf16 runs themselves: tests/integration/test_bf16.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the mark it had beside the bf16 runs: every marker set stays as it was


def test_a_bf16_row_is_grouped_with_the_bf16_baseline():
    """The report (and the sweep's noise-floor reruns) key baselines by precision too."""
    from types import SimpleNamespace

    from parallel_lab.report.table import Row, baseline_key

    def row(strategy: str, options: dict) -> Row:
        same = dict(model="cnn", params=321290, global_batch=64, steps=20, data="synthetic", optimizer="adam", lr=1e-3)
        same.update(norm="group")
        return Row(strategy, SimpleNamespace(strategy=strategy, strategy_options=options, **same))

    single_fp32, single_bf16 = row("single", {"precision": "fp32"}), row("single", {"precision": "bf16"})
    fsdp_bf16, zero2_fp32 = row("fsdp", {"mixed_precision": "bf16"}), row("zero2", {"precision": "fp32"})
    assert baseline_key(fsdp_bf16) == baseline_key(single_bf16) != baseline_key(single_fp32)
    assert baseline_key(zero2_fp32) == baseline_key(single_fp32)
