#!/usr/bin/env bash
# FP8 GEMMs in the decoder layers (engine.fp8=tensorwise, scenarios/llama1b_h200/fp8.py; declared tier
# loss_curve) on one H200: speed against the bf16 default and the surpass verdict. Parts (PARTS, default "p8 s8"):
#   p8: A-B-A on the 8B proxy at GBS 8 (micro-batch 1 x grad-accum 8, median of 6): A the scenario default, B with
#       engine.fp8=tensorwise (profiled unless NOPROF=1), A again (about 200 s);
#   s8: surpass on the 8B proxy (P8: GBS 1, 300 steps) vs the stored 5-seed golden with engine.fp8=tensorwise on
#       top of the default (about 110 s);
#   p1: A-B-A on llama1b_h200 at its real shape and GBS 16 (micro-batch 4 x grad-accum 4), B engine.fp8=tensorwise
#       (about 110 s);
#   s1: surpass of llama1b_h200 at the real shape (R1B) vs its 5-seed golden, with engine.fp8=tensorwise
#       (about 150 s).
# TAG names the files (default fp8); more than 8 files come back as one TAG.tgz.
#   run: bash experiments/fp8/ab_surpass_h200.sh ; PARTS="p1 s1" bash experiments/fp8/ab_surpass_h200.sh
#   (carry [".whl"])
set -u
. scripts/device/setup.sh
. scripts/device/shapes.sh   # P8, R1B, FIVE
for part in ${PARTS:-p8 s8}; do
  case $part in
    p8) aba ${TAG:-fp8} "engine.fp8=tensorwise" ;;
    p1) ABA_W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=16" aba ${TAG:-fp8}_1b \
          "engine.fp8=tensorwise" ;;
    s8|s1)
      [ $part = s8 ] && W=$P8 || W=$R1B
      echo "$(ts) == $part: surpass with engine.fp8=tensorwise vs 5 seeds ($(left) s left)"
      timeout $(left) python3 -m forgetrain.verify $W engine.fp8=tensorwise tier=surpass verify.golden=true "$FIVE" \
        verify.out_dir=/tmp/v27$part 2>&1 | filt 8
      cp /tmp/v27$part/verdict.json $OUT/${TAG:-fp8}_fp8_${part}_verdict.json 2>/dev/null
      cp /tmp/v27$part/loss_curves.png $OUT/${TAG:-fp8}_fp8_${part}_loss_curves.png 2>/dev/null ;;
  esac
done
pack ${TAG:-fp8}  # more than 8 files: one tgz
echo "$(ts) done"
