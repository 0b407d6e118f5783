#!/usr/bin/env bash
# The packed SwiGLU kernel (kernels.swiglu=triton: forward on the fused fc1 output [gate | up], a backward kernel
# that writes d(fc1) whole) A-B-A on the 8B proxy on one H200, in one call:
#   0. unless NOSEAL=1: validate + seal swiglu on CUDA (the registry that comes back, swiglu_registry.json,
#      replaces forgetrain/kernels/registry.json; then add swiglu to CUDA_SEALED in tests/test_kernel_switches.py);
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, warm-up 2, median of 6,
#      the forged engine alone: A the scenario default with kernels.swiglu=torch, B kernels.swiglu=triton (profiled
#      unless NOPROF=1), A again;
#   4. unless NOTOL=1: the tolerance tier of the fast base with kernels.swiglu=triton vs Megatron-core (T of
#      shapes.sh), verdict and plot;
#   5. with ATTN=1: experiments/attention/layouts_h200.py (its JSON would be a ninth file; 8 come back).
#   run: bash experiments/swiglu/ab_8b_proxy_h200.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
if [ -z "${NOSEAL:-}" ]; then
  echo "$(ts) == 0. validate + seal swiglu on CUDA ($(left) s left)"
  timeout 120 python3 -m forgetrain.kernels seal --kernel swiglu --device cuda --shapes full --repeats 20 --warmup 5 \
    --registry forgetrain/kernels/registry.json --json $OUT/swiglu_seal.json 2>&1 | filt 4
  cp forgetrain/kernels/registry.json $OUT/swiglu_registry.json
fi
ABA_A=${ABA_A-kernels.swiglu=torch} aba swiglu "kernels.swiglu=triton kernels.allow_unsealed=${UNSEALED:-false}"
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + kernels.swiglu=triton vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE kernels.swiglu=triton \
    kernels.allow_unsealed=${UNSEALED:-false} verify.out_dir=/tmp/v19 2>&1 | filt 4
  cp /tmp/v19/verdict.json $OUT/tol_swiglu_packed_verdict.json 2>/dev/null
  cp /tmp/v19/loss_curves.png $OUT/tol_swiglu_packed_loss_curves.png 2>/dev/null
fi
if [ -n "${ATTN:-}" ]; then
  echo "$(ts) == 5. attention layouts ($(left) s left)"
  timeout $(( $(left) - 5 )) python3 experiments/attention/layouts_h200.py 2>&1 | filt 30
fi
echo "$(ts) done"
