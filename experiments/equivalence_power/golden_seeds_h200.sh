#!/usr/bin/env bash
# Add Megatron-core reference seeds to a stored H200 loss-curve golden, so that the paired test has the 5 seeds it
# needs (at the 8B proxy, 3 seeds leave the fast default's own interval wider than the margin; see
# docs/equivalence_power.md). Each new seed is one live reference run (verify.make_golden=true, one seed per verify
# call, as references/goldens/README.md describes), then its init hash is pinned (verify.pin_init=true over all
# of the golden's seeds). The golden's new seed_N/ directories come back in one archive; extract it at the repo
# root and commit them.
#   SHAPE=r1b NEW=1237,1238 bash experiments/equivalence_power/golden_seeds_h200.sh      (carry [".whl"])
# Out: $OUT/<shape>_golden_seeds.tgz (references/goldens/h200/<golden>/seed_N/ for every seed, init.json included)
# and $OUT/<shape>_golden_seeds.log.
set -uo pipefail
source scripts/device/setup.sh
source scripts/device/shapes.sh
case "${SHAPE:?SHAPE=p8|r1b}" in
  p8) W="$P8"; OLD=1234,1235,1236,1237,1238 ;;
  r1b) W="$R1B"; OLD=1234,1235,1236 ;;
  *) echo "error: SHAPE=p8|r1b, got $SHAPE"; exit 2 ;;
esac
LOG="$OUT/${SHAPE}_golden_seeds.log"
for s in $(echo "${NEW:?NEW=1237,1238}" | tr ',' ' '); do
  echo "$(ts) == reference seed $s ($(left) s left)" | tee -a "$LOG"
  timeout $(( $(left) - 30 )) python3 -m forgetrain.verify $W tier=loss_curve verify.make_golden=true \
    "verify.seeds=[$s]" verify.out_dir=/tmp/golden_seed_$s >> "$LOG" 2>&1 \
    || { echo "seed $s: failed" | tee -a "$LOG"; break; }
done
ALL="$OLD,$NEW"
echo "$(ts) == pin the init hashes of seeds $ALL ($(left) s left)" | tee -a "$LOG"
timeout $(( $(left) - 15 )) python3 -m forgetrain.verify $W tier=loss_curve verify.golden=true verify.pin_init=true \
  "verify.seeds=[$ALL]" verify.init_cache=/tmp/ftinit verify.out_dir=/tmp/golden_pin >> "$LOG" 2>&1
grep -vE "Warning|warnings.warn|^\s*$" "$LOG" | tail -30
G=$(ls -td references/goldens/h200/*-loss_curve-* | head -1)
tar czf "$OUT/${SHAPE}_golden_seeds.tgz" references/goldens/h200 && echo "$(ts) done: $G"
