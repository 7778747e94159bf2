"""``python -m parallel_lab.bench cluster_advice``: the "which strategy when" table for GPUs, generated
by the cluster recommender (parallel_lab/plan/cluster/recommend.py): for each model (the gpt presets
generic_1.3b, generic_7b, generic_13b, generic_70b) on 8, 64 and 512 GPUs of a profile (h100_sxm by
default), the top pick among the layouts that fit, its predicted step, tokens/s/GPU, MFU and memory,
and the runner-up of another strategy family. docs/cluster.md shows the table; the run is kept in
benchmarks/results/ with this command.
"""

from __future__ import annotations

import argparse

from parallel_lab.config import compose_config
from parallel_lab.plan.cluster.layout import describe

PRESETS = ("generic_1.3b", "generic_7b", "generic_13b", "generic_70b")
GPUS = (8, 64, 512)


def pick(preset: str, gpus: int, hardware: str, global_batch: int) -> list:
    """The recommender's fitting candidates for one (model, cluster), best first."""
    from parallel_lab.plan.cluster.hardware import from_config
    from parallel_lab.plan.cluster.recommend import ordered, other_strategies, pipeline_strategy, rank
    from parallel_lab.plan.cluster.shape import from_model_config

    given = [
        "model=gpt",
        f"model.preset={preset}",
        f"plan.hardware={hardware}",
        f"plan.gpus={gpus}",
        f"trainer.global_batch={global_batch}",
        "plan.fused_attention=true",
    ]
    cfg = compose_config(given)
    shape, hw = from_model_config(cfg.model, True), from_config(cfg.plan.hardware)
    ranked = ordered(
        rank(shape, hw, gpus, global_batch, "bf16", pipeline_strategy()) + other_strategies(cfg, given, gpus)
    )
    return [c for c in ranked if c.fits]


def family(command: str) -> str:
    """The strategy a candidate's command names (its first override)."""
    return command.split()[0].partition("=")[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parallel_lab.bench cluster_advice", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hardware", default="h100_sxm", help="a conf/hardware profile (default h100_sxm)")
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences per step (default 1024)")
    args = parser.parse_args(argv)
    print(f"{args.hardware}, global batch {args.global_batch} sequences, bf16, fused attention")
    print("| model | GPUs | top pick | step s | tokens/s/GPU | MFU | GiB/GPU | next best other strategy (step s) |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in PRESETS:
        for gpus in GPUS:
            fits = pick(preset, gpus, args.hardware, args.global_batch)
            if not fits:
                print(f"| {preset} | {gpus} | nothing fits | | | | | |")
                continue
            best, p = fits[0], fits[0].prediction
            other = next((c for c in fits if family(c.command) != family(best.command)), None)
            runner = (
                f"{family(other.command)}: {describe(other.run)} ({other.prediction.step_time_s:.2f})" if other else "-"
            )
            print(
                f"| {preset} | {gpus} | {family(best.command)}: {describe(best.run)}, micro-batch {p.micro_batch}, "
                f"recompute {best.run.recompute} | {p.step_time_s:.2f} | {p.tokens_per_s_per_gpu:,.0f} | "
                f"{100 * p.mfu:.1f}% | {p.memory_bytes_per_gpu / 2**30:.1f} | {runner} |"
            )
    return 0
