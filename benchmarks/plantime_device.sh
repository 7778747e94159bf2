#!/usr/bin/env bash
# One prepared command for a lent GPU machine: the step-time model's calibration there (issue 35
# item 5), well under 8 minutes. The quick calibration (operator micro-benchmarks, Adam; nccl
# collectives at world 2 when the machine has >= 2 GPUs, none on one) and the calibration set's
# world-1 rows (single cnn, fp32 and bf16, profiled) on CUDA, fitted and written as a calibration
# json that load_or_measure_calibration reads; then held-out world-1 rows predicted from that fit.
# Run from the checkout's root on the GPU machine, with the wheels its image lacks in .whl/ (as
# benchmarks/gpu_check.sh):
#     bash benchmarks/plantime_device.sh [OUT]        (OUT: default ./plantime_out)
set -u
out=${1:-${OUT:-plantime_out}}
mkdir -p "$out"
. "$(dirname "$0")/device_env.sh"
log=$out/plantime_device.log
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$log"
start=$SECONDS
# --world1: the calibration set's world-1 rows and world1_calibration (fsdp at one rank), once per
# round, then world1_held_out (conf/bench/plantime.yaml): the model fitted on the GPU, judged on
# rows it never saw; the fitted calibration is the json's "fitted", copied to calibration.json for
# load_or_measure_calibration. --steps 12 (4 warm-up, 2 traced, 6 timed), not the CPU default of 20:
# 19 runs (one discarded) start in ~16 s each there.
timeout 460 python3 -m parallel_lab.bench plantime --world1 --device cuda --rounds 2 --steps 12 \
  --out "$out/plantime_gpu.json" 2>&1 | tee -a "$log"
echo "exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$log"
# Cut off (2026-11-27: at 420 s, while scoring, every run done): what was measured is replayed into
# the same outputs; --replay needs no GPU.
if [ ! -s "$out/plantime_gpu.json" ] && [ -s "$out/plantime_gpu.partial.json" ]; then
  timeout 120 python3 -m parallel_lab.bench plantime --replay "$out/plantime_gpu.partial.json" \
    --calibration "$out/plantime_gpu.calibration.json" --out "$out/plantime_gpu.json" 2>&1 | tee -a "$log"
fi
python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['fitted'], indent=1))" \
  "$out/plantime_gpu.json" >"$out/calibration.json"
