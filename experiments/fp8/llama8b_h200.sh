#!/usr/bin/env bash
# llama8b_h200 (full-depth Llama-3-8B at its default: optimizer offload 0.65, engine.free_qkv, no recompute, the
# Triton SwiGLU and CE-chunk kernels) with FP8 GEMMs on one H200, forged alone at GBS 8 (micro-batch 1 x
# grad-accum 8), median of 6, no profile. Compare with experiments/llama8b_h200/kernels_ab_h200.sh's B arm (the
# same workload in bf16). Peak memory matters: the bf16 default already runs about 133.5 of the 139.8 GiB the
# allocator sees.
#   run: bash experiments/fp8/llama8b_h200.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
W="scenario=llama8b_h200 parallel.timeout_s=60 train.global_batch_size=8 train.deterministic=false bench.against=[]"
echo "$(ts) == forged, llama8b_h200 + engine.fp8=tensorwise + both kernels ($(left) s left)"
timeout $(( $(left) - 20 )) python3 -m forgetrain.bench $W bench.steps=6 bench.warmup=2 bench.single_micro_batch=false \
  engine.fp8=tensorwise kernels.swiglu=triton kernels.ce_chunk=triton bench.profile=false bench.out_dir=/tmp/c31 2>&1 \
  | grep -E "^forged |error|OOM|out of memory|note"
cp /tmp/c31/bench.json $OUT/llama8b_h200_fp8_bench.json 2>/dev/null
echo "$(ts) done"
