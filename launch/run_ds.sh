#!/usr/bin/env bash
''':'
# The raw DeepSpeed launcher on one node (CPU or GPU), without our own process supervisor. Either:
#
#   deepspeed [--num_gpus N] [--master_port P] launch/run_ds.sh [overrides...]     as DeepSpeed users type it
#   bash launch/run_ds.sh [overrides...]              e.g. bash launch/run_ds.sh strategy=zero2 trainer.steps=20
#   NPROC=2 MASTER_PORT=29500 RUN_DIR=runs/ds/x bash launch/run_ds.sh strategy=zero3 strategy.offload=cpu
#
# DeepSpeed's own flags work in both: --deepspeed_config ds_config.json (= strategy.ds_config=..., the
# strategy then zero<its stage> unless strategy= is given) and --deepspeed.
#
# This file is bash AND Python. The deepspeed launcher runs `python -u launch/run_ds.sh --local_rank=N ...`
# per rank: Python reads this bash half as a string and runs the code at the bottom
# (parallel_lab/cli/ds_script.py: rank 0 writes the validated config, every rank runs the worker on it).
# Bash reads the first quote as the no-op command ":" and exits before the Python half.
#
# Under bash: step 1 writes the validated <run_dir>/config.yaml (python -m parallel_lab.prepare: same config
# and errors as `python -m parallel_lab`, before anything starts). Step 2 is the plain deepspeed command:
# --num_gpus is the local process count (on CPU it starts that many ranks; plain `deepspeed x.py` starts one),
# the launcher passes --local_rank=N, which the worker accepts. It does not set OMP_NUM_THREADS, so we do.
# `python -m parallel_lab launcher=deepspeed ...` runs the same command under our supervisor.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_DIR=${RUN_DIR:-runs/ds/$(date +%Y-%m-%d_%H-%M-%S)}
PY=${PYTHON:-$(command -v python)}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
DS=$(dirname "$PY")/deepspeed
[ -x "$DS" ] || DS=deepspeed

config=$("$PY" -m parallel_lab.prepare "$RUN_DIR" launcher=deepspeed "world_size=$NPROC" "$@")
# DeepSpeed's accelerator is the device the parent resolved (it counted the GPUs: device: cpu|cuda).
device=$(sed -n 's/^device: //p' "$config")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-$device}
"$DS" --num_nodes 1 --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" --module parallel_lab.worker "$config"
"$PY" -c 'import sys; from parallel_lab.report.table import summary_line; print(summary_line(sys.argv[1]))' "$RUN_DIR/metrics.json"
exit 0
: <<'#end-of-python'
'''
# ---- Python: one rank started by the deepspeed launcher ----
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
from parallel_lab.cli.ds_script import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
#end-of-python
