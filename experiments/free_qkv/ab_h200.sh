#!/usr/bin/env bash
# The engine.free_qkv memory lever on one H200. The compiled block saves V for attention's backward as a view into
# the fused QKV output, which keeps all (nq + 2 nkv) d of it alive: for Llama-3-8B that is (32 + 8) x 128 bf16
# values per token and layer beyond V itself, 2.5 GiB over 32 layers x 8192 tokens. engine.free_qkv copies V out.
#   0. experiments/free_qkv/saved_tensors.py at one Llama-3-8B layer (seq 8192, compiled, gradient-accumulation
#      fusion as the scenarios run it), without and with the switch: what the layer saves against the estimate's term;
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, median of 6, forged alone:
#      A the scenario default, B engine.free_qkv=true (profiled unless NOPROF=1; its peak should be 4 x 80 MiB
#      lower, its step no slower: one [8192, 1024] bf16 copy per layer), A again;
#   4. unless NOTOL=1: the declared tier, tolerance, vs Megatron-core (T of shapes.sh) on the fast base.
#   run: bash experiments/free_qkv/ab_h200.sh   (carry [".whl"]; about 5 min)
set -u
. scripts/device/setup.sh
echo "$(ts) == 0. saved tensors of one Llama-3-8B layer, compiled, fused ($(left) s left)"
for fq in "" --free-qkv; do
  timeout 120 python3 experiments/free_qkv/saved_tensors.py --fused $fq \
    --json $OUT/free_qkv_saved_tensors${fq:+_free_qkv}.json 2>&1 | filt 14
done
aba free_qkv "engine.free_qkv=true"
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + engine.free_qkv=true vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE engine.free_qkv=true \
    verify.out_dir=/tmp/v21 2>&1 | filt 4
  cp /tmp/v21/verdict.json $OUT/tol_free_qkv_verdict.json 2>/dev/null
  cp /tmp/v21/loss_curves.png $OUT/tol_free_qkv_loss_curves.png 2>/dev/null
fi
echo "$(ts) done"
