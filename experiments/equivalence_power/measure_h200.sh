#!/usr/bin/env bash
# The loss-curve tier's power on one H200, against the stored 5-seed golden of the 8B proxy (P8) or the 1B real
# shape (R1B) of scripts/device/shapes.sh: the fast default and planted regressions (plants.py), each judged by
# forgetrain.verify's judge, paired against every seed's reference init regenerated from its seed, or unpaired.
# One part per device call (each fits the 600 s limit; the inits are cached on the machine's disk between parts
# while it stays warm):
#   PART=p8_default   pin the golden's 5 inits (init.json comes back under $OUT/p8_default/init_json/), then the
#                     default paired on 5 seeds, and the default repeated on 3 (the noise floor) if time is left
#   PART=p8_plants    learning rate x0.95, FP8 (engine.fp8=tensorwise), CE in bf16, paired on 3 seeds
#   PART=p8_init      the unpaired check: the default and the output projections without 1/sqrt(2L), 3 seeds
#                     each; then main grads rounded to bf16, paired on 3 seeds
#   PART=r1b_default, r1b_plants, r1b_init: the same on the 1B real shape (its golden has seeds 1234-1236)
# Run from the repo root with carry [".whl"] (scripts/device/wheels.sh fills it):
#   PART=p8_default bash experiments/equivalence_power/measure_h200.sh
set -uo pipefail
source scripts/device/setup.sh
source scripts/device/shapes.sh
case "${PART:?PART=p8_default|p8_plants|p8_init|r1b_default|r1b_plants|r1b_init}" in
  p8_*) W="$P8 $FIVE"; ALL=1234,1235,1236,1237,1238 ;;
  r1b_*) W="$R1B verify.seeds=[1234,1235,1236]"; ALL=1234,1235,1236 ;;
esac
case "$PART" in
  *_default) P=default,repeat; SEEDS=$ALL ;;
  *_plants) P=lr_x0.95,fp8,bf16_ce; SEEDS=1234,1235,1236 ;;
  *_init) P=default_unpaired,no_output_scaling,bf16_grad_accum; SEEDS=1234,1235,1236 ;;
esac
PLANTS=${PLANTS:-$P}  # PLANTS=a,b runs those plants instead (the part still picks the shape and seeds)
# a machine that went back in between lost the cache: the new one regenerates what it needs (its hash checked)
df -h /tmp | tail -1
python3 experiments/equivalence_power/run.py --out "$OUT/$PART" --plants "$PLANTS" --seeds "$SEEDS" \
  --budget-s $(( $(left) - 25 )) -- $W verify.init_cache=/tmp/ftinit 2>&1 \
  | grep -vE "Warning|warnings.warn|^\s*$" | tail -40
cp "$OUT/$PART/power.json" "$OUT/${PART}_power.json" 2>/dev/null
tar czf "$OUT/$PART.tgz" -C "$OUT" "$PART" && rm -rf "${OUT:?}/$PART"  # the traces lie 4 folders down
