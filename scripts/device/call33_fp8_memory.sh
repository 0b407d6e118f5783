#!/usr/bin/env bash
# Device call 33 (one H200), for the memory estimate under engine.fp8=tensorwise (not modelled yet): what one
# compiled Llama-3-8B decoder layer (seq 8192, micro-batch 1, gradient-accumulation fusion, free_qkv as in
# llama8b_h200) holds for its backward, bf16 and FP8, by saved-tensor hooks and by the allocator (the hooks do not
# see the e4m3 tensors a compiled FP8 block saves). On the H200 llama8b_h200's peak fell 7.5 GiB with FP8 (133.5 ->
# 126.0 GiB) where an analytic count of the saved tensors predicts about +2 GiB; these two rows say which is right.
#   run: bash scripts/device/call33_fp8_memory.sh   (carry [".whl"]; about 2 min)
set -u
. scripts/device/setup.sh
for f in "" "--fp8"; do
  echo "$(ts) == saved_tensors --fused --free-qkv $f ($(left) s left)"
  timeout $(( $(left) - 10 )) python3 scripts/device/saved_tensors.py --fused --free-qkv $f \
    --json $OUT/call33_saved_tensors${f:+_fp8}.json 2>&1 | head -30
done
echo "$(ts) done"
