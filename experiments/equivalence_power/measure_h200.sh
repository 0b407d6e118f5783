#!/usr/bin/env bash
# The loss-curve tier's power on one H200, against a stored golden of scripts/device/shapes.sh (SHAPE=p8: the 8B
# proxy, 5 seeds; SHAPE=r1b: the 1B real shape, seeds 1234-1236): the fast default and planted regressions
# (plants.py), each judged by forgetrain.verify's judge, paired against every seed's reference init regenerated
# from its seed (its sha256 checked against the golden's init.json; pinned first where the golden has none), or
# unpaired from the candidate's own init. About 55 s a 300-step run at the 8B proxy, so two plants on 5 seeds fill
# one call; the inits stay cached on the machine's disk while it is warm.
#   SHAPE=p8 PLANTS=default,repeat bash experiments/equivalence_power/measure_h200.sh
# Optional: SEEDS=1234,1235,1236 (paired seeds; default every golden seed), BUDGET (s, default 585).
# Carry [".whl"] (scripts/device/wheels.sh fills it). Results: $OUT/<tag>_power.json and $OUT/<tag>.tgz (every
# verdict, plot and candidate trace).
set -uo pipefail
source scripts/device/setup.sh
source scripts/device/shapes.sh
case "${SHAPE:?SHAPE=p8|r1b}" in
  p8) W="$P8 $FIVE"; ALL=1234,1235,1236,1237,1238 ;;
  r1b) W="$R1B verify.seeds=[1234,1235,1236]"; ALL=1234,1235,1236 ;;
  *) echo "error: SHAPE=p8|r1b, got $SHAPE"; exit 2 ;;
esac
TAG="${SHAPE}_$(echo "${PLANTS:?PLANTS=a,b (plants.py)}" | tr ',' '_')"
df -h /tmp | tail -1
python3 experiments/equivalence_power/run.py --out "$OUT/$TAG" --plants "$PLANTS" --seeds "${SEEDS:-$ALL}" \
  --budget-s $(( $(left) - 60 )) -- $W verify.init_cache=/tmp/ftinit 2>&1 \
  | grep -vE "Warning|warnings.warn|^\s*$" | tail -40
cp "$OUT/$TAG/power.json" "$OUT/${TAG}_power.json" 2>/dev/null
tar czf "$OUT/$TAG.tgz" -C "$OUT" "$TAG" && rm -rf "${OUT:?}/$TAG"  # the traces lie 4 folders down
