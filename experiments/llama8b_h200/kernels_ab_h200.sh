#!/usr/bin/env bash
# Device call 25 (one H200), issues 13 and 18: llama8b_h200 (full-depth Llama-3-8B, its default: optimizer offload
# 0.65, engine.free_qkv, no recompute) with the two Triton kernels the other Hopper scenarios run by default since
# 2026-12-03 (eighth session): kernels.swiglu=triton (1.0% on the 8B proxy, 1.8% on the 1B) and kernels.ce_chunk=triton
# (0.4% on the 8B proxy), both sealed on CUDA with their tolerance passed at the T shape. One-machine A-B-A at GBS 8
# (micro-batch 1 x grad-accum 8, about 6.7 s a step), forged alone, median of 6: A the scenario default, B with both
# kernels (NOPROF=1 by default here: a profiled 8B step at full depth is a large trace), A again. The peak memory of B
# matters as much as its speed: the default runs 133.5 GiB of the 139.8 GiB the allocator sees.
#   run: bash scripts/device/call25_h200_kernels.sh   (carry [".whl"]; about 7-8 min, a call of its own)
set -u
. scripts/device/setup.sh
NOPROF=${NOPROF-1} ABA_W="scenario=llama8b_h200 parallel.timeout_s=60 train.global_batch_size=8" \
  aba call25 "kernels.swiglu=triton kernels.ce_chunk=triton"
echo "$(ts) done"
