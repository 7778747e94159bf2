#!/usr/bin/env bash
# The training run under mpirun, both ways, for one or more strategies.
#
#   launch/run_mpi.sh [strategy[,strategy...]] [hydra overrides...]
#   launch/run_mpi.sh                      # strategy=ddp, world_size=2 (the config default)
#   launch/run_mpi.sh ddp,zero2 trainer.steps=20 world_size=2
#
# For each strategy:
#  1. the easy path: the CLI validates the config, writes <run_dir>/config.yaml and execs
#     `mpiexec -n <world_size> python -m parallel_lab.worker <run_dir>/config.yaml` for you:
#         python -m parallel_lab strategy=ddp launcher=mpirun
#  2. the raw form: that same mpiexec command, typed by hand on the config.yaml the CLI wrote.
#     No MASTER_ADDR/PORT is set: the worker reads rank/size from MPICH's PMI_RANK/PMI_SIZE (or
#     Open MPI's OMPI_COMM_WORLD_*), and rank 0 broadcasts a free port over MPI
#     (parallel_lab/comm/dist_env.py). It rewrites metrics.json in the same run dir; the first
#     run's metrics are kept as metrics.launcher.json.
#  3. a check that both forms logged the same losses.
# Env: PYTHON (default: the venv's python, else python3), RUN_ROOT (default runs/mpi/<time>).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATEGIES=ddp
if [[ $# -gt 0 && $1 != *=* ]]; then STRATEGIES=$1; shift; fi
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
BIN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
MPIEXEC=$BIN/mpiexec
[[ -x $MPIEXEC ]] || MPIEXEC=$(command -v mpiexec || command -v mpirun || true)
if [[ -z $MPIEXEC ]]; then
  echo "run_mpi.sh: error: no mpiexec found; install MPI with pip install mpi4py mpich (make installs it)" >&2
  exit 2
fi
RUN_ROOT=${RUN_ROOT:-runs/mpi/$(date +%Y-%m-%d_%H-%M-%S)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

for STRATEGY in ${STRATEGIES//,/ }; do
  RUN_DIR=$RUN_ROOT/$STRATEGY
  echo "== $STRATEGY: 1. python -m parallel_lab strategy=$STRATEGY launcher=mpirun $* hydra.run.dir=$RUN_DIR"
  "$PYTHON" -m parallel_lab "strategy=$STRATEGY" launcher=mpirun "$@" "hydra.run.dir=$RUN_DIR"
  mv "$RUN_DIR/metrics.json" "$RUN_DIR/metrics.launcher.json"

  NP=$("$PYTHON" -c 'import sys; from omegaconf import OmegaConf; print(OmegaConf.load(sys.argv[1]).world_size)' "$RUN_DIR/config.yaml")
  echo "== $STRATEGY: 2. $MPIEXEC -n $NP $PYTHON -m parallel_lab.worker $RUN_DIR/config.yaml"
  "$MPIEXEC" -n "$NP" "$PYTHON" -m parallel_lab.worker "$RUN_DIR/config.yaml"

  echo "== $STRATEGY: 3. compare the losses of 1. and 2."
  "$PYTHON" - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
a = json.loads((run / "metrics.launcher.json").read_text())["losses"]
b = json.loads((run / "metrics.json").read_text())["losses"]
if a != b:
    sys.exit(f"run_mpi.sh: error: losses differ between launcher=mpirun and raw mpiexec in {run}: {a} vs {b}")
print(f"{run}: launcher=mpirun and raw mpiexec give identical losses ({len(a)} steps, final {a[-1]:.6f})")
PY
done
