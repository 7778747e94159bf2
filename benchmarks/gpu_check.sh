#!/usr/bin/env bash
# One prepared command for a lent GPU machine (docs/gpu.md): every strategy's CUDA path at world
# size 1, the profiler's CUDA path, BatchNorm on CUDA, and the vision transformer, each judged by
# the same parity criterion as on CPU. Run from the checkout's root on the GPU machine, with the
# wheels its image lacks (hydra-core, omegaconf, antlr4, deepspeed, pydantic, hjson) in .whl/:
#     bash benchmarks/gpu_check.sh [OUT]        (OUT: where the tables go; default ./gpu_out)
# Each stage has its own timeout, so one hung stage does not eat the others' time.
set -u
out=${1:-${OUT:-gpu_out}}
mkdir -p "$out"
. "$(dirname "$0")/device_env.sh"
log=$out/gpu_check.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$log"

stage() {  # stage NAME SECONDS ARGS...: one sweep; its comparison.md lands in $out/NAME.md
  local name=$1 seconds=$2; shift 2
  local dir=/tmp/gpu_runs/$name start=$SECONDS
  echo "== $name: $*" | tee -a "$log"
  timeout "$seconds" python3 -m parallel_lab "$@" device=cuda world_size=1 hydra.sweep.dir="$dir" >"/tmp/$name.txt" 2>&1
  echo "exit $? after $((SECONDS - start)) s" | tee -a "$log"
  tail -n 25 "/tmp/$name.txt" >>"$log"
  cp "$dir/comparison.md" "$out/$name.md" 2>/dev/null || echo "(no comparison.md)" | tee -a "$log"
}

# Sized for a 15-minute device lease: each sweep adds seven noise-floor reruns of single, and a run
# costs ~8-10 s on the GPU machine (process start, CUDA context), so a sweep of n strategies takes
# ~(n + 7) x 10 s. The whole compare_all (18 runs) needs ~200-250 s on its own.
stage vit_profiled 170 -m strategy=single,ddp,fsdp,zero3 model=vit trainer.steps=20 trainer.profile=true
stage resnet_batchnorm 110 -m strategy=single,ddp model=resnet18 model.norm=batch trainer.steps=10
