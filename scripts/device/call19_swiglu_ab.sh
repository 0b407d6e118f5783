#!/usr/bin/env bash
# Device call 19 (one H200): the SwiGLU lever A-B-A in one call. Call 18 (2026-12-03, fifth session) timed the
# 8B proxy at GBS 8 with kernels.swiglu=triton at 1.0604 s against the default's 1.0237 s of the previous session;
# a cross-session gap that size is within machine drift, so this times the default (A) and kernels.swiglu=triton
# (B) alone, A-B-A, on one machine: the forged engine only, 8B proxy (llama8b_h100, 4 layers, seq 8192),
# micro-batch 1 x grad-accum 8, warm-up 2, median of 6. Then scripts/device/attn_layouts.py unless NOATTN=1.
#   run: bash scripts/device/call19_swiglu_ab.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
P="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8 \
train.deterministic=false bench.against=[] bench.steps=6 bench.warmup=2 bench.single_micro_batch=false"
i=0
for arm in A B A; do
  i=$((i+1))
  sw=$([ $arm = B ] && echo "kernels.swiglu=triton kernels.allow_unsealed=${UNSEALED:-false}" || echo "")
  echo "$(ts) == $i. forged alone, arm $arm ${sw:-(scenario default)} ($(left) s left)"
  timeout $(( $(left) - 30 )) python3 -m forgetrain.bench $P $sw bench.out_dir=/tmp/b19_$i 2>&1 | grep -E "^forged |error" 
  cp /tmp/b19_$i/bench.json $OUT/call19_bench_${i}_$arm.json 2>/dev/null
done
if [ -z "${NOATTN:-}" ]; then
  echo "$(ts) == attention layouts ($(left) s left)"
  timeout $(( $(left) - 5 )) python3 scripts/device/attn_layouts.py 2>&1 | filt 30
fi
echo "$(ts) done"
