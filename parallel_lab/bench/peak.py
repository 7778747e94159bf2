"""``python -m parallel_lab.bench peak``: this machine's own peak GFLOP/s, what a sweep's MFU divides by.

A square matmul and a 3x3 convolution, in fp32 and bf16 (the dtypes a run computes in), on the CPU
with each thread count given (a rank's ``trainer.threads``) and, where there is one, on the GPU:
the fastest of repeated calls, never below one thread's figure (parallel_lab/worker/metrics.py
peaks_for, the code a sweep runs once per dtype and thread count in its parent).
"""

from __future__ import annotations

import argparse
import os

import torch

from parallel_lab.worker.metrics import DTYPES, peaks_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench peak", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), action="append", help="default: fp32 and bf16")
    parser.add_argument("--threads", type=int, action="append", help="CPU threads (default: 1 and every core)")
    parser.add_argument("--device", choices=("cpu", "cuda"), action="append", help="default: cpu, and cuda if present")
    args = parser.parse_args(argv)
    devices = args.device or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    threads = sorted(set(args.threads or [1, os.cpu_count() or 1]))
    wanted = {
        (device, dtype, n)
        for device in devices
        for dtype in args.dtype or ["fp32", "bf16"]
        for n in (threads if device == "cpu" else [1])
    }
    print(
        f"{'device':<24} {'dtype':<5} {'threads':>7} {'matmul GFLOP/s':>15} {'conv GFLOP/s':>13} {'peak':>9}  peak from"
    )
    for p in peaks_for(wanted):
        name = p["device_name"] or p["device"]
        print(
            f"{name:<24} {p['dtype']:<5} {p['threads']:>7} {p['matmul_gflops']:>15.1f} {p['conv_gflops']:>13.1f} "
            f"{p['peak_gflops']:>9.1f}  {p['peak_from']}"
        )
    return 0
