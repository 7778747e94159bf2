"""``python -m parallel_lab.bench ds_estimate [--model cnn|resnet18] [--world N] [metrics.json ...]``

DeepSpeed's own model-state estimators beside the toolkit's analytic bytes (and measured bytes, from
the ``metrics.json`` of zero2/zero3 runs given as arguments), per rank, same model, same world size.

DeepSpeed's ``estimate_zero2/3_model_states_mem_needs_all_live`` print a table; the numbers come
from ``estimate_zero2/3_model_states_mem_needs`` (called here with the same arguments). They assume
mixed precision on GPUs: 16-bit parameters (2Ψ, on every GPU at stage 2, partitioned at stage 3
plus the largest layer gathered, 4 bytes/param of it), and per GPU 18/N bytes/param of
2 (16-bit grads) + 4 (fp32 grads) + 4 (fp32 master) + 8 (Adam) -- without offload. Their "CPU" column
is host memory needed to load/offload, times a 1.5 buffer factor. The toolkit's analytic numbers are
the ZeRO paper's for the run's precision (fp32 here: 4 + 4 + 8 bytes/param, the fp32 master
partition counted apart), the measured ones read from DeepSpeed's real buffers. The planner's
columns are DeepSpeed's real layout (``strategies/zero/predict.py``, exact against runs), the rank
holding the most; ``bench zero_paper`` sets the three side by side at Ψ = 7.5 B.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf

from parallel_lab.strategies.zero import zero_stage


def _ours(stage: int, world: int, params: int, precision: str) -> int:
    from parallel_lab.strategies.zero.memory import analytic_zero_memory

    trainer = OmegaConf.create({"optimizer": "adam", "momentum": 0.9})
    return sum(analytic_zero_memory(stage, precision, world, trainer, params).values())


def _measured(paths: list[str]) -> dict[tuple[int, int], int]:
    """(stage, world) -> rank 0's measured model-state bytes, from zero2/zero3 metrics.json files."""
    keys = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")
    found = {}
    for path in paths:
        m = json.loads(Path(path).read_text())
        stage = zero_stage(m.get("strategy") or "")
        if stage in (2, 3):
            found[(stage, m["world_size"])] = sum(m["ranks"][0].get(k, 0) for k in keys)
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench ds_estimate")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("metrics", nargs="*", help="metrics.json of zero2/zero3 runs of this model and world")
    args = parser.parse_args(argv)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import model_to_params as params_and_largest
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from parallel_lab.bench.zero_paper import plan_bytes
    from parallel_lab.models import build_meta_model, build_model

    model = build_model(OmegaConf.create({"name": args.model, "num_classes": 10}), 0)
    params, largest = params_and_largest(model)
    meta = build_meta_model(OmegaConf.create({"name": args.model, "num_classes": 10}))
    measured = _measured(args.metrics)
    n = args.world
    print(f"{args.model}: {params} parameters (largest layer {largest}), {n} ranks; MiB per rank")
    print(
        "| stage | DeepSpeed est. GPU (no offload) | DeepSpeed est. CPU | ours fp32 | ours bf16 "
        "| plan fp32 | plan bf16 | measured fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for stage in (2, 3):
        if stage == 2:
            cpu, gpu = estimate_zero2_model_states_mem_needs(params, n, 1, cpu_offload=False)
        else:
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, n, 1, cpu_offload=False)
        fp32, bf16 = _ours(stage, n, params, "fp32"), _ours(stage, n, params, "bf16")
        plan = [plan_bytes(meta, args.model, 1.0, stage, n, precision)[0] for precision in ("fp32", "bf16")]
        meas = measured.get((stage, n))
        cells = [gpu, cpu, fp32, bf16, *plan] + ([meas] if meas else [])
        print(f"| {stage} | " + " | ".join(f"{c / 2**20:.2f}" for c in cells) + (" |" if meas else " | - |"))
    return 0
