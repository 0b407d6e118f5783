#!/usr/bin/env bash
# Surpass of llama8b_h100 on one H200 as its 4-layer proxy (full 8B width, seq 8192, micro-batch 1, global batch 1,
# bf16), 300 steps, against a loss-curve golden of 5 Megatron-core seeds (P8 of scripts/device/shapes.sh; stored:
# references/goldens/h200/llama8b_h100-loss_curve-24b726ebc7bf). Megatron-core (local spec) needs ~117 GiB here, so
# the surpass timing runs in A-B-A blocks (one engine in memory at a time). Each seed is about 170 s; the judgement
# about 100-200 s.
#   PART=a: golden seeds 1234 1235 1236.   PART=b: seeds 1237 1238, then the fast default at surpass.
#   SEEDS overrides the part's seeds; SEEDS= PART=b runs the judgement alone. CAND adds candidate overrides and
#   TAG names its files, e.g. SEEDS= PART=b TAG=fp8 CAND="engine.fp8=tensorwise" (the surpass evidence a default
#   flip needs).
#   run: SEEDS= PART=b bash experiments/surpass/llama8b_proxy_h200.sh   (carry [".whl"])
# A golden made here comes back as a tar: extract it at the repo root before the next call.
set -u
. scripts/device/setup.sh
. scripts/device/shapes.sh   # P8
P=$P8
[ "${PART:-a}" = a ] && D="1234 1235 1236" || D="1237 1238"
SEEDS=${SEEDS-$D}   # SEEDS="" PART=b: the judgement alone
for s in $SEEDS; do
  echo "$(ts) == golden seed $s ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $P tier=loss_curve verify.make_golden=true "verify.seeds=[$s]" \
    verify.out_dir=/tmp/g$s 2>&1 | filt 2
  rm -rf /tmp/g$s
  tar cf $OUT/surpass_8b_proxy_golden_${PART:-a}.tar references/goldens/h200 2>/dev/null
done
if [ "${PART:-a}" = b ]; then
  # CAND: extra candidate overrides (the levers before they enter the scenario default), TAG names the files
  CAND=${CAND:-}; TAG=${TAG:-fast_default}
  echo "$(ts) == $TAG [${CAND}]: surpass vs 5 seeds ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $P $CAND tier=surpass verify.golden=true \
    "verify.seeds=[1234,1235,1236,1237,1238]" verify.out_dir=/tmp/v8 verify.init_cache=/tmp/ftinit 2>&1 | filt 8
  cp /tmp/v8/verdict.json $OUT/surpass_8b_proxy_${TAG}_verdict.json 2>/dev/null
  cp /tmp/v8/loss_curves.png $OUT/surpass_8b_proxy_${TAG}_loss_curves.png 2>/dev/null
fi
echo "$(ts) done"
