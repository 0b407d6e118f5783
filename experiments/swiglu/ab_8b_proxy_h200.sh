#!/usr/bin/env bash
# Device call 19 (one H200): the SwiGLU lever A-B-A in one call. Call 18 (2026-12-03, fifth session) timed the
# 8B proxy at GBS 8 with kernels.swiglu=triton at 1.0604 s against the default's 1.0237 s of the previous session;
# this call's first run (same session) timed A 1.0470 / B 1.0584 / A 1.0463 s on one machine: B 1.1% slower. The
# profile showed why: the compiled block cloned the two mutated dx slices the packed backward passed to its kernel
# and scattered them back (21 ms a step). The packed backward now has its own kernel writing dx whole.
#   0. unless NOSEAL=1: validate + seal swiglu on CUDA (the kernel source changed; the registry that comes back,
#      call19_registry.json, replaces forgetrain/kernels/registry.json; then add swiglu to CUDA_SEALED in
#      tests/test_kernel_switches.py);
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, warm-up 2, median of 6,
#      the forged engine alone: A the scenario default, B kernels.swiglu=triton (profiled unless NOPROF=1: the
#      copy kernels around the SwiGLU backward should be gone), A again;
#   4. unless NOTOL=1: the tolerance tier of the fast base with kernels.swiglu=triton vs Megatron-core (T of
#      shapes.sh), verdict and plot;
#   5. with ATTN=1: scripts/device/attn_layouts.py (its JSON would be a ninth file; 8 come back).
#   run: bash scripts/device/call19_swiglu_ab.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
if [ -z "${NOSEAL:-}" ]; then
  echo "$(ts) == 0. validate + seal swiglu on CUDA ($(left) s left)"
  timeout 120 python3 -m forgetrain.kernels seal --kernel swiglu --device cuda --shapes full --repeats 20 --warmup 5 \
    --registry forgetrain/kernels/registry.json --json $OUT/call19_swiglu_seal.json 2>&1 | filt 4
  cp forgetrain/kernels/registry.json $OUT/call19_registry.json
fi
aba call19 "kernels.swiglu=triton kernels.allow_unsealed=${UNSEALED:-false}"
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + kernels.swiglu=triton vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE kernels.swiglu=triton \
    kernels.allow_unsealed=${UNSEALED:-false} verify.out_dir=/tmp/v19 2>&1 | filt 4
  cp /tmp/v19/verdict.json $OUT/call19_tol_swiglu_packed_verdict.json 2>/dev/null
  cp /tmp/v19/loss_curves.png $OUT/call19_tol_swiglu_packed_loss_curves.png 2>/dev/null
fi
if [ -n "${ATTN:-}" ]; then
  echo "$(ts) == 5. attention layouts ($(left) s left)"
  timeout $(( $(left) - 5 )) python3 scripts/device/attn_layouts.py 2>&1 | filt 30
fi
echo "$(ts) done"
