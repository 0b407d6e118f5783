#!/usr/bin/env bash
# llama8b_h200 (full-depth Llama-3-8B at its default: optimizer offload 0.65, engine.free_qkv, no recompute) with
# and without the two Triton kernels the other Hopper scenarios run: kernels.swiglu=triton and
# kernels.ce_chunk=triton (both sealed on CUDA, tolerance passed at the T shape; both in llama8b_h200's default
# now, so A sets them to torch through ABA_A). One-machine A-B-A at GBS 8 (micro-batch 1 x grad-accum 8, about
# 6.7 s a step), forged alone, median of 6: A without the kernels, B with both (NOPROF=1 by default here: a profiled
# 8B step at full depth is a large trace), A again. The peak memory of B matters as much as its speed: the default
# runs about 133.5 GiB of the 139.8 GiB the allocator sees.
#   run: bash experiments/llama8b_h200/kernels_ab_h200.sh   (carry [".whl"]; about 7-8 min, a call of its own)
set -u
. scripts/device/setup.sh
NOPROF=${NOPROF-1} ABA_A=${ABA_A-"kernels.swiglu=torch kernels.ce_chunk=torch"} ABA_W="scenario=llama8b_h200 parallel.timeout_s=60 train.global_batch_size=8" \
  aba kernels "kernels.swiglu=triton kernels.ce_chunk=triton"
echo "$(ts) done"
