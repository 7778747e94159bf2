"""Assertions several test modules make on a run's metrics."""

from __future__ import annotations


def assert_losses_close(losses, reference, rtol: float) -> None:
    assert len(losses) == len(reference)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b} (rtol {rtol})"


def assert_plan_matches(metrics: dict, tolerance: float = 0.01) -> None:
    """Every rank's model-state bytes (params + master + grads + optimizer) are within tolerance
    of the planner's prediction the worker stored beside them (``predicted_*``, parallel_lab.plan)."""
    from parallel_lab.plan.verify import rank_errors, stored_predictions

    for row in rank_errors(metrics, stored_predictions(metrics)):
        assert row["predicted"], f"{metrics['strategy']} rank {row['rank']}: no predicted_* in metrics.json"
        assert abs(row["error"]) <= tolerance, (metrics["strategy"], row)
