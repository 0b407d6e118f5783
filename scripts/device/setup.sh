#!/usr/bin/env bash
# Sourced at the start of every device call: installs the carried wheels (.whl, filled by
# scripts/device/wheels.sh; .whl_sides too where a call carries it) into /tmp/site and points PYTHONPATH at them and the repo. Keeps NVLink multicast off.
T0=$(date +%s)  # the call's clock starts before the install, so BUDGET bounds the whole command (the device's limit is 600 s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl_sides/*.whl 2>/dev/null) \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FORGETRAIN_CACHE=/tmp/ftcache WANDB_MODE=offline
mkdir -p "$OUT"
python3 - <<'PY'
import torch, triton, sys
print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} "
      f"gpu {torch.cuda.get_device_name()} cuda {torch.version.cuda}")
PY
# Helpers for the call scripts: a timestamp, the seconds left of the call's BUDGET (default 585 s), and a filter
# that drops warnings and blank lines and keeps the last N lines of a command's output.
ts() { date +%H:%M:%S; }
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - T0) )); }
filt() { grep -vE "Warning|warn|^\s*$" | tail -${1:-6}; }
