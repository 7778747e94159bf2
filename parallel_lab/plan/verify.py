"""Check the plan against what runs measured.

    python -m parallel_lab.plan.verify <run or sweep folder> [...]

For every metrics.json under the folders, the run's own config.yaml is planned again (the same
``predict_memory`` the worker stored as ``predicted_*``) and compared, per rank and per kind of
model state, with the bytes the run measured. Prints a markdown table; exit 1 if any rank's
model-state total is off by more than ``--tolerance`` (default 1%).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from parallel_lab.plan.predict import MODEL_STATE, predicted_metrics

TOLERANCE = 0.01


def relative_error(predicted: int, measured: int) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def rank_errors(metrics: dict, predicted_by_rank: list[dict]) -> list[dict]:
    """Per rank: measured and predicted bytes of each kind, and the relative error of the total."""
    out = []
    for rank, pred in zip(metrics["ranks"], predicted_by_rank):
        if not pred:
            out.append({"rank": rank["rank"], "predicted": None})
            continue
        row = {"rank": rank["rank"], "predicted": True}
        for k in MODEL_STATE:
            row[k] = (rank.get(k, 0), pred.get(f"predicted_{k}", 0))
        measured = sum(m for m, _ in (row[k] for k in MODEL_STATE))
        predicted = sum(p for _, p in (row[k] for k in MODEL_STATE))
        row["total"] = (measured, predicted)
        row["error"] = relative_error(predicted, measured)
        out.append(row)
    return out


def stored_predictions(metrics: dict) -> list[dict]:
    """The predicted_* the worker stored in each ranks[k] (empty dicts where none)."""
    return [{k: r[k] for k in r if k.startswith("predicted_")} for r in metrics["ranks"]]


def replanned(run_dir: Path, metrics: dict) -> list[dict]:
    """Plan the run's own config.yaml again (for runs made before predictions were stored)."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies import get_strategy_class

    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = build_meta_model(cfg.model)
    cls = get_strategy_class(cfg.strategy.name)
    return [predicted_metrics(cfg, cls, model, r["rank"]) for r in metrics["ranks"]]


def verify_run(run_dir: Path) -> tuple[dict, list[dict]]:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    stored = stored_predictions(metrics)
    predictions = stored if all(stored) else replanned(run_dir, metrics)
    return metrics, rank_errors(metrics, predictions)


def _pct(pair: tuple[int, int]) -> str:
    measured, predicted = pair
    err = relative_error(predicted, measured)
    return f"{measured:,} / {predicted:,} ({100 * err:+.2f}%)" if err else f"{measured:,} (exact)"


def table(run_dirs: list[Path]) -> tuple[str, float]:
    """Markdown table of every rank of every run, and the largest |error| of a model-state total."""
    lines = [
        "| run | model | world | rank | params measured / predicted | master | grads | optim | model state error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for run_dir in run_dirs:
        metrics, rows = verify_run(run_dir)
        for row in rows:
            head = f"| {metrics['strategy']} | {metrics['model']} | {metrics['world_size']} | {row['rank']} |"
            if not row["predicted"]:
                lines.append(head + " no prediction | | | | |")
                continue
            worst = max(worst, abs(row["error"]))
            cells = [_pct(row[k]) for k in MODEL_STATE]
            lines.append(head + " " + " | ".join(cells) + f" | {100 * row['error']:+.3f}% |")
    return "\n".join(lines), worst


def summary_table(run_dirs: list[Path]) -> str:
    """One line per run: model-state MiB per rank measured, and the largest error over the ranks
    of the plan (exact) and of the ZeRO paper's formula (``analytic_*``, textbook)."""
    lines = [
        "| model | strategy | world | model state MiB per rank (measured) | plan error (max over ranks) "
        "| paper formula error (max over ranks) |",
        "|---|---|---|---|---|---|",
    ]
    for run_dir in sorted(run_dirs, key=lambda d: _order(json.loads((d / "metrics.json").read_text()))):
        metrics, rows = verify_run(run_dir)
        if not all(r["predicted"] for r in rows):
            continue
        textbook = [{f"predicted_{k}": r.get(f"analytic_{k}", 0) for k in MODEL_STATE} for r in metrics["ranks"]]
        paper = max(abs(r["error"]) for r in rank_errors(metrics, textbook))
        plan = max(abs(r["error"]) for r in rows)
        per_rank = ", ".join(f"{r['total'][0] / 2**20:.3f}" for r in rows)
        lines.append(
            f"| {metrics['model']} | {metrics['strategy']} | {metrics['world_size']} | {per_rank} "
            f"| {'0 (exact)' if plan == 0 else f'{100 * plan:.3f}%'} | {100 * paper:.2f}% |"
        )
    return "\n".join(lines)


def _order(metrics: dict) -> tuple:
    return (metrics["model"], metrics["world_size"], metrics["strategy"])


def comm_table(run_dirs: list[Path]) -> str:
    """Communication per step of rank 0: counted by the run vs predicted (``predict_comm``), by collective."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies import get_strategy_class

    lines = [
        "| run | model | world | measured MiB/step | predicted MiB/step | error | by collective (measured / plan) |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for run_dir in run_dirs:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        cfg = OmegaConf.load(run_dir / "config.yaml")
        predicted = get_strategy_class(cfg.strategy.name).plan.predict_comm(cfg, build_meta_model(cfg.model), 0)
        measured = metrics["ranks"][0]["comm_bytes_by_op"]
        head = f"| {metrics['strategy']} | {metrics['model']} | {metrics['world_size']} |"
        if predicted is None:
            lines.append(head + f" {sum(measured.values()) / 2**20:.4f} | no prediction | | |")
            continue
        total_m, total_p = sum(measured.values()), sum(predicted.values())
        ops = sorted(set(measured) | set(predicted))
        by_op = ", ".join(f"{op} {measured.get(op, 0) / 2**20:.4g} / {predicted.get(op, 0) / 2**20:.4g}" for op in ops)
        err = (
            f"{100 * relative_error(int(total_p), int(total_m)):+.3f}%"
            if total_m
            else ("exact" if not total_p else "?")
        )
        lines.append(head + f" {total_m / 2**20:.4f} | {total_p / 2**20:.4f} | {err} | {by_op} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.plan.verify", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--comm", action="store_true", help="also compare communication per step (rank 0)")
    parser.add_argument("--summary", action="store_true", help="one line per run: plan vs paper formula error")
    args = parser.parse_args(argv)
    runs = sorted({p.parent for d in args.dirs for p in d.rglob("metrics.json")})
    text, worst = table(runs)
    print(text)
    print(
        f"\nlargest model-state error: {100 * worst:.3f}% over {len(runs)} runs (tolerance {100 * args.tolerance:g}%)"
    )
    if args.summary:
        print("\n" + summary_table(runs))
    if args.comm:
        print("\n" + comm_table(runs))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
