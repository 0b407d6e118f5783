#!/usr/bin/env bash
# Device call 21 (one H200), the engine.free_qkv memory lever. On CPU (2026-12-03, sixth session) the compiled block
# saves V for attention's backward as a view into the fused QKV output, which keeps all (nq + 2 nkv) d of it alive:
# for Llama-3-8B that is (32 + 8) x 128 bf16 values per token and layer beyond V itself, 2.5 GiB over 32 layers x
# 8192 tokens, the gap measured between the estimate and llama8b_h200's peaks. engine.free_qkv copies V out.
#   0. scripts/device/saved_tensors.py at one Llama-3-8B layer (seq 8192, compiled, gradient-accumulation fusion as
#      the scenarios run it), without and with the switch: what the layer saves against the estimate's term;
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, median of 6, forged alone:
#      A the scenario default, B engine.free_qkv=true (profiled unless NOPROF=1; its peak should be 4 x 80 MiB
#      lower, its step no slower: one [8192, 1024] bf16 copy per layer), A again;
#   4. unless NOTOL=1: the declared tier, tolerance, vs Megatron-core (T of shapes.sh) on the fast base.
#   run: bash scripts/device/call21_free_qkv.sh   (carry [".whl"]; about 5 min)
# Measured 2026-12-03 (seventh session, 176 s): 80 MiB less saved per layer, within 0.35% of the estimate; proxy
# A-B-A 1.0056 / 1.0101 / 1.0055 s, 40.0 -> 39.7 GiB; tolerance pass (docs/benchmarks.md).
set -u
. scripts/device/setup.sh
echo "$(ts) == 0. saved tensors of one Llama-3-8B layer, compiled, fused ($(left) s left)"
for fq in "" --free-qkv; do
  timeout 120 python3 scripts/device/saved_tensors.py --fused $fq \
    --json $OUT/call21_saved_tensors${fq:+_free_qkv}.json 2>&1 | filt 14
done
aba call21 "engine.free_qkv=true"
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + engine.free_qkv=true vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE engine.free_qkv=true \
    verify.out_dir=/tmp/v21 2>&1 | filt 4
  cp /tmp/v21/verdict.json $OUT/call21_tol_free_qkv_verdict.json 2>/dev/null
  cp /tmp/v21/loss_curves.png $OUT/call21_tol_free_qkv_loss_curves.png 2>/dev/null
fi
echo "$(ts) done"
