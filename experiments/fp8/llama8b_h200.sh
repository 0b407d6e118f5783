#!/usr/bin/env bash
# Device call 31 (one H200), issue 13: llama8b_h200 (full-depth Llama-3-8B, its default: optimizer offload 0.65,
# engine.free_qkv, no recompute) with FP8 GEMMs and both Triton kernels on top, arm B of call25 only (call25 measured
# arm A, the default, at 6.7311 s and the two kernels at 6.6624 s, both 133.5 GiB peak). Forged alone at GBS 8
# (micro-batch 1 x grad-accum 8), median of 6, no profile. Peak memory matters: FP8 keeps e4m3 copies of the saved
# activations' transposes, and the default already runs 133.5 of the 139.8 GiB the allocator sees.
#   run: bash scripts/device/call31_fp8_8b.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
W="scenario=llama8b_h200 parallel.timeout_s=60 train.global_batch_size=8 train.deterministic=false bench.against=[]"
echo "$(ts) == forged, llama8b_h200 + engine.fp8=tensorwise + both kernels ($(left) s left)"
timeout $(( $(left) - 20 )) python3 -m forgetrain.bench $W bench.steps=6 bench.warmup=2 bench.single_micro_batch=false \
  engine.fp8=tensorwise kernels.swiglu=triton kernels.ce_chunk=triton bench.profile=false bench.out_dir=/tmp/c31 2>&1 \
  | grep -E "^forged |error|OOM|out of memory|note"
cp /tmp/c31/bench.json $OUT/call31_bench_fp8_kernels.json 2>/dev/null
echo "$(ts) done"
