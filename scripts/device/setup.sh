#!/usr/bin/env bash
# Sourced at the start of every device call: installs the carried wheels (.whl, filled by
# scripts/device/wheels.sh) into /tmp/site and points PYTHONPATH at them and the repo. Keeps NVLink multicast off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FORGETRAIN_CACHE=/tmp/ftcache WANDB_MODE=offline
mkdir -p "$OUT"
python3 - <<'PY'
import torch, triton, sys
print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} "
      f"gpu {torch.cuda.get_device_name()} cuda {torch.version.cuda}")
PY
