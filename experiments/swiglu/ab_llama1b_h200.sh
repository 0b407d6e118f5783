#!/usr/bin/env bash
# Device call 24 (one H200), the performance issue's 1B goal: llama1b_h200 at its real shape (Llama-3.2-1B width,
# 16 layers, seq 4096, V 128256) and the production-like batch, micro-batch 4 x grad-accum 4 (GBS 16), forged
# alone, median of 6: A the scenario default, B with kernels.swiglu=triton (the packed SwiGLU kernel that
# llama8b_h100 runs by default since 2026-12-03: sealed on CUDA, tolerance passed at the T shape, 1.0% faster on the
# 8B proxy), profiled unless NOPROF=1, A again. EXTRA_B adds more B overrides (e.g. kernels.ce_chunk=triton once
# call23 has sealed it). B replaces the B overrides: B=kernels.ce_chunk=triton (A then is the default with swiglu,
# since 2026-12-03's eighth session); TAG names the files (default call24). No tier check: the kernel's declared tier (tolerance) was judged at the T shape, which is
# the 1B scenario's own engine.
#   run: bash scripts/device/call24_1b_swiglu.sh   (carry [".whl"]; three bench processes, about 4 min)
set -u
. scripts/device/setup.sh
ABA_W="scenario=llama1b_h200 hardware=h200 train.micro_batch_size=4 train.global_batch_size=16" \
  aba ${TAG:-call24} "${B:-kernels.swiglu=triton} ${EXTRA_B:-}"
echo "$(ts) done"
