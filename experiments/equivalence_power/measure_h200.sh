#!/usr/bin/env bash
# The loss-curve tier's power on one H200, against a stored golden of scripts/device/shapes.sh (SHAPE=p8: the 8B
# proxy; SHAPE=r1b: the 1B real shape; 5 seeds each, golden_seeds_h200.sh adds missing ones): the fast default and
# planted regressions (plants.py), each judged by forgetrain.verify's judge, paired against every seed's reference
# init regenerated from its seed (its sha256 checked against the golden's init.json; pinned first where the golden
# has none), or unpaired from the candidate's own init. A 300-step run at the 8B proxy takes about 55 s once its
# seed's init is cached on the machine's disk (/tmp/ftinit, kept while the machine stays warm: fire the next call
# at once), and about 90 s while it is rebuilt; so one call holds one plant on 5 seeds cold, or a 5-seed plant and
# a 3-seed one warm.
#   SHAPE=p8 PLANTS=default,repeat bash experiments/equivalence_power/measure_h200.sh
# Optional: SEEDS=1234,1235,1236 (paired seeds; default every golden seed), BUDGET (s, default 585).
# Carry [".whl"] (scripts/device/wheels.sh fills it). Results: $OUT/<tag>_power.json and $OUT/<tag>.tgz (every
# verdict, plot and candidate trace).
set -uo pipefail
source scripts/device/setup.sh
source scripts/device/shapes.sh
case "${SHAPE:?SHAPE=p8|r1b}" in
  p8) W="$P8 $FIVE"; ALL=1234,1235,1236,1237,1238 ;;
  r1b) W="$R1B $FIVE"; ALL=1234,1235,1236,1237,1238 ;;  # seeds 1237-1238: golden_seeds_h200.sh first
  *) echo "error: SHAPE=p8|r1b, got $SHAPE"; exit 2 ;;
esac
TAG="${SHAPE}_$(echo "${PLANTS:?PLANTS=a,b:N (plants.py; :N its first N seeds)}" | tr ',:' '_-')"
df -h /tmp | tail -1
timeout -k 5 $(( $(left) - 25 )) python3 experiments/equivalence_power/run.py --out "$OUT/$TAG" --plants "$PLANTS" --seeds "${SEEDS:-$ALL}" \
  --budget-s $(( $(left) - 30 )) -- $W verify.init_cache=/tmp/ftinit > "$OUT/$TAG.log" 2>&1  # a cut call keeps its log and
# its archive below (a driver stalled past its budget is stopped first)
grep -vE "Warning|warnings.warn|^\s*$" "$OUT/$TAG.log" | tail -40
cp "$OUT/$TAG/power.json" "$OUT/${TAG}_power.json" 2>/dev/null
# the traces lie 4 folders down: one archive of every small file (no checkpoints, no weights)
(cd "$OUT" && find "$TAG" -name checkpoints -prune -o -name '*.safetensors' -prune -o -type f -print \
  | tar czf "$TAG.tgz" -T - && rm -rf "${OUT:?}/$TAG")
