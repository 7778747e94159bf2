"""``python -m parallel_lab.bench hardware [--out FILE] [--device cpu|cuda]``: this machine's
profile for the cluster planner (conf/hardware/this_machine.yaml by default), measured with the
project's own calibration: the peak per dtype (``bench peak``'s ``worker.metrics.peaks_for``), the
memory bandwidth and the collectives' latency and bandwidth between two processes from the quick
calibration (``plan.calibrate.measure_calibration``: its ``memory`` kind and gloo's (nccl's on a
GPU) all-reduce alpha-beta fit). On a GPU: run it there and pass the file's name to plan.hardware.
Every field's comment says how it was measured or what was assumed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from parallel_lab.plan.cluster.hardware import FIELDS, from_config

CPU_OVERHEAD_BYTES = 512 << 20  # assumption: one rank's interpreter, torch and buffers


def measure(device: str) -> tuple[dict, dict[str, str]]:
    """(the profile's values, each field's source)."""
    import torch

    from parallel_lab.plan.calibrate import measure_calibration
    from parallel_lab.worker.metrics import peaks_for

    threads = 1 if device == "cuda" else os.cpu_count() or 1
    peaks = {p["dtype"]: p["peak_gflops"] / 1e3 for p in peaks_for({(device, d, threads) for d in ("fp32", "bf16")})}
    calib = measure_calibration(device)
    per_byte = calib.ops.get("memory@fp32", {}).get("per_unit_s") or 1e-10
    impl = next(iter(calib.collectives), None)
    reduce = calib.collectives.get(impl, {}).get("all_reduce", {"alpha_s": 1e-4, "beta_Bps": 1e9}) if impl else {}
    link_gbs = reduce.get("beta_Bps", 1e9) / 1e9
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        from parallel_lab.config.resources import memory_available_bytes

        memory = memory_available_bytes() or 0
    values = {
        "name": "this_machine",
        "peak_tflops": {"bf16": peaks.get("bf16", 0.0), "fp16": peaks.get("bf16", 0.0), "fp32": peaks.get("fp32", 0.0)},
        "hbm_bytes": int(memory),
        "hbm_gb_per_s": 1.0 / per_byte / 1e9,
        "gpus_per_node": torch.cuda.device_count() if device == "cuda" else os.cpu_count() or 1,
        "intra_node_gb_per_s": link_gbs,
        "inter_node_gbps": link_gbs * 8,
        "intra_node_latency_us": reduce.get("alpha_s", 1e-4) * 1e6,
        "inter_node_latency_us": reduce.get("alpha_s", 1e-4) * 1e6,
        "gemm_efficiency": 1.0,
        "gemm_half_dim": 16.0,
        "attention_efficiency": {"fwd": 1.0, "fwd_causal": 1.0, "bwd": 1.0, "bwd_causal": 1.0},
        "memory_efficiency": 1.0,
        "link_efficiency": 1.0,
        "overhead_bytes": CPU_OVERHEAD_BYTES if device == "cpu" else 2 << 30,
        "allocator_slack": 0.0 if device == "cpu" else 0.11,
    }
    measured = f"measured on {device} by python -m parallel_lab.bench hardware"
    sources = {
        "peak_tflops": f"{measured}: bench peak's matmul/conv peak at {threads} thread(s) (fp16 taken as bf16's)",
        "hbm_bytes": f"{measured}: {'CUDA device 0 total memory' if device == 'cuda' else 'MemAvailable'}",
        "hbm_gb_per_s": f"{measured}: the calibration's memory kind (bytes per second of elementwise ops)",
        "gpus_per_node": "this machine's devices (CPU: its cores, one rank each)",
        "intra_node_gb_per_s": f"{measured}: {impl} all-reduce between 2 processes, fitted bandwidth",
        "inter_node_gbps": "the same figure (one machine: no network measured)",
        "intra_node_latency_us": f"{measured}: {impl} all-reduce between 2 processes, fitted latency",
        "inter_node_latency_us": "the same figure (one machine: no network measured)",
        "gemm_efficiency": "1.0: the peak above is already what this machine reaches",
        "gemm_half_dim": "assumption, not measured",
        "attention_efficiency": "1.0: no fused attention kernel measured; set a kernel benchmark's share of peak",
        "memory_efficiency": "1.0: the bandwidth above is already achieved",
        "link_efficiency": "1.0: the bandwidth above is already achieved",
        "overhead_bytes": "assumption: a rank's interpreter, torch and buffers",
        "allocator_slack": "CPU ranks: no caching allocator reserve"
        if device == "cpu"
        else "assumption: bench published's fitted share",
    }
    return values, sources


def to_yaml(values: dict, sources: dict[str, str]) -> str:
    """A profile's yaml, each field followed by the comment naming its source."""
    lines = [f"# {values['name']}: written by python -m parallel_lab.bench hardware."]
    for key in [k for k in FIELDS if k in values]:
        value = values[key]
        if isinstance(value, dict):
            lines.append(f"{key}:  # {sources.get(key, '')}")
            lines += [f"  {k}: {v:.6g}" for k, v in value.items()]
        elif key == "name":
            lines.append(f"name: {value}")
        else:
            shown = f"{value:.6g}" if isinstance(value, float) else str(value)
            lines.append(f"{key}: {shown}  # {sources.get(key, '')}")
    return "\n".join(lines) + "\n"


def write_profile(values: dict, sources: dict[str, str], out: Path) -> Path:
    """Write the yaml (never half-written) and read it back as a profile (a bad one raises)."""
    import yaml

    text = to_yaml(values, sources)
    from_config(yaml.safe_load(text))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    from parallel_lab.plan.cluster.hardware import profile_path

    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench hardware", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=profile_path("this_machine"), help="the yaml to write")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = write_profile(*measure(device), args.out)
    print(path.read_text(), end="")
    print(f"written: {path} (plan.hardware={path.stem} where it lies in conf/hardware/)")
    return 0
