#!/usr/bin/env bash
# The raw torchrun form of a parallel_lab run, for when you want torchrun's own flags.
#   launch/run_torchrun.sh [overrides...]      e.g. launch/run_torchrun.sh strategy=ddp trainer.steps=50
# Step 1 writes the resolved config with the CLI (Hydra runs only here, in the parent);
# step 2 is the command `launcher=torchrun` runs for you: torchrun starts the workers on it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
run_dir=${RUN_DIR:-runs/torchrun/$(date +%Y%m%d-%H%M%S)}
# Validate and write <run_dir>/config.yaml without training (world_size must match NPROC).
config=$("$PY" -m parallel_lab.prepare "$run_dir" launcher=torchrun world_size="$NPROC" "$@")
"$PY" -m torch.distributed.run --nnodes=1 --nproc_per_node="$NPROC" \
    --master_addr=127.0.0.1 --master_port="${MASTER_PORT:-29500}" \
    -m parallel_lab.worker "$config"
"$PY" -m parallel_lab.report "$run_dir"
