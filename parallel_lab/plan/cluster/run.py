"""``python -m parallel_lab.plan plan.hardware=<name> plan.gpus=N ...``: the cluster prediction,
printed and written to ``plan.json`` (``step_time_s``, ``memory_bytes_per_gpu``, ``tflops_per_gpu``,
``mfu`` and every part)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.plan.cluster.layout import cluster_run, describe, shape_text
from parallel_lab.plan.cluster.steptime import ClusterPrediction, ClusterRun, predict

GIB = 2**30
STEP_PARTS = (
    ("compute_s", "compute (recomputation included)"),
    ("tp_comm_s", "exposed tensor/context-parallel communication"),
    ("bubble_s", "pipeline bubble"),
    ("pp_p2p_s", "pipeline sends"),
    ("dp_comm_s", "exposed data-parallel/ZeRO/FSDP communication"),
    ("optimizer_s", "optimizer"),
)


def report(run: ClusterRun, pred: ClusterPrediction) -> str:
    """The prediction as text: per-GPU memory by part, the step by part, the rates."""
    hw = run.hw
    lines = [
        f"Cluster plan: {shape_text(run.shape)}",
        f"on {run.gpus} x {hw.name} ({hw.gpus_per_node} per node, {hw.intra_node_gb_per_s:g} GB/s NVLink, "
        f"{hw.inter_node_gbps:g} Gb/s per GPU between nodes): {describe(run)}",
        f"global batch {run.global_batch} x seq {run.shape.seq}, micro-batch {pred.micro_batch}, {run.precision}, "
        f"recompute {run.recompute}, optimizer {run.optimizer}",
        "",
        f"per-GPU memory: {pred.memory_bytes_per_gpu / GIB:.2f} GiB of {hw.hbm_bytes / GIB:.0f} GiB"
        + ("" if pred.memory_bytes_per_gpu <= hw.hbm_bytes else "  (DOES NOT FIT)"),
    ]
    state = sum(v for k, v in pred.memory.items() if k.startswith("model_state"))
    lines.append(
        f"  model state {state / GIB:10.2f} GiB  ("
        + ", ".join(
            f"{k.removeprefix('model_state_')} {v / GIB:.2f}"
            for k, v in pred.memory.items()
            if k.startswith("model_state")
        )
        + ")"
    )
    lines.append(f"  activations {pred.memory['activations'] / GIB:10.2f} GiB")
    lines.append(f"  buffers     {pred.memory['buffers'] / GIB:10.2f} GiB")
    lines.append(f"  allocator   {pred.memory['allocator_reserve'] / GIB:10.2f} GiB  (the caching allocator's reserve)")
    lines += ["", f"step time: {pred.step_time_s:.3f} s"]
    for key, label in STEP_PARTS:
        value = getattr(pred, key)
        lines.append(f"  {label:<48} {value:9.3f} s  {100 * value / pred.step_time_s:5.1f}%")
        if key == "tp_comm_s" and run.layout.dims.cp > 1:
            lines.append(f"    {'of which context-parallel (' + run.cp_impl + ')':<46} {pred.cp_comm_s:9.3f} s")
    lines += [
        "",
        f"tokens/s/GPU {pred.tokens_per_s_per_gpu:,.0f}; achieved {pred.tflops_per_gpu:.1f} TFLOP/s per GPU "
        f"(recomputation counted, as Megatron reports); MFU {100 * pred.mfu:.1f}% of "
        f"{hw.peak_tflops.get(run.precision, 0):g} TFLOP/s {run.precision}",
    ]
    return "\n".join(lines)


def run_cluster(cfg: DictConfig, overrides: list[str], out: Path) -> Path:
    """Predict, write cluster_plan.md and plan.json under ``out``; the text's path."""
    run = cluster_run(cfg, overrides)
    pred = predict(run)
    out.mkdir(parents=True, exist_ok=True)
    text = report(run, pred)
    (out / "cluster_plan.md").write_text(text + "\n")
    record = {
        **pred.to_json(),
        "gpus": run.gpus,
        "hardware": run.hw.name,
        "layout": describe(run),
        "model": shape_text(run.shape),
        "precision": run.precision,
        "recompute": run.recompute,
        "global_batch": run.global_batch,
    }
    tmp = out / "plan.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(out / "plan.json")
    return out / "cluster_plan.md"
