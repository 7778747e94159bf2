# Sourced by the prepared GPU-machine commands (gpu_check.sh, plantime_device.sh): the wheels the
# machine's image lacks, from .whl/ beside the checkout when present, on PYTHONPATH before the
# checkout; unbuffered output, so a stage's log is complete when its timeout kills it.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
