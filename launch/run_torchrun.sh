#!/usr/bin/env bash
# The raw torchrun form of a parallel_lab run, for when you want torchrun's own flags.
#   launch/run_torchrun.sh [overrides...]      e.g. launch/run_torchrun.sh strategy=ddp trainer.steps=50
# Step 1 writes the resolved config with the CLI (Hydra runs only here, in the parent);
# step 2 is the command `launcher=torchrun` runs for you: torchrun starts the workers on it.
#
# Several hosts: run it on every host with the same RUN_DIR (on a filesystem all of them see),
# NNODES, MASTER_ADDR (host 0's address) and MASTER_PORT, and each host's own NODE_RANK:
#   host0$ NNODES=2 NODE_RANK=0 NPROC=1 MASTER_ADDR=node0 RUN_DIR=/shared/runs/x launch/run_torchrun.sh strategy=ddp
#   host1$ NNODES=2 NODE_RANK=1 NPROC=1 MASTER_ADDR=node0 RUN_DIR=/shared/runs/x launch/run_torchrun.sh strategy=ddp
# Host 0 writes config.yaml (world_size = NNODES x NPROC); the others wait for it. This is what
# `python -m parallel_lab launcher=torchrun launcher.hosts=[node0,node1] launcher.remote_shell=null`
# prints, and what it starts through ssh when it can reach the hosts (docs/multinode.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ $NNODES -gt 1 && -z ${RUN_DIR:-} ]]; then
  echo "run_torchrun.sh: error: NNODES=$NNODES needs RUN_DIR=<folder every host sees>; set the same RUN_DIR on every host" >&2
  exit 2
fi
run_dir=${RUN_DIR:-runs/torchrun/$(date +%Y%m%d-%H%M%S)}
config=$run_dir/config.yaml
if [[ $NODE_RANK -eq 0 ]]; then
  # Validate and write <run_dir>/config.yaml without training (world_size must be NNODES x NPROC).
  nodes=()
  [[ $NNODES -gt 1 ]] && nodes=("launcher.nodes=$NNODES" "launcher.master_addr=$MASTER_ADDR")
  config=$("$PY" -m parallel_lab.prepare "$run_dir" launcher=torchrun world_size=$((NNODES * NPROC)) \
      "launcher.nproc_per_node=$NPROC" "${nodes[@]}" "$@")
else
  for _ in $(seq 120); do [[ -f $config ]] && break; sleep 0.5; done
  [[ -f $config ]] || { echo "run_torchrun.sh: error: $config did not appear in 60 s; start NODE_RANK=0 first" >&2; exit 2; }
fi
"$PY" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
    --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}" \
    -m parallel_lab.worker "$config"
if [[ $NODE_RANK -eq 0 ]]; then "$PY" -m parallel_lab.report "$run_dir"; fi
