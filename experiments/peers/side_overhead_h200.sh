#!/usr/bin/env bash
# Is a bench side's step time its own? One H200 call at the 8B proxy, GBS 8 (micro-batch 1 x grad-accum 8):
#   1. SIDE (default torch_compile) alone in a fresh process (experiments/peers/side_alone.py), one profiled step;
#   2. the bench of every side in one call (bench_all_sides.sh) with AGAINST=SIDE and PROFILE=1: the forged engine,
#      the FP8 candidate and SIDE, each profiled, SIDE built after the forged blocks were freed.
# The same side timed alone and in the bench, minutes apart on one machine: a gap is the harness's (what a freed
# forged block leaves behind), no gap puts the side's distance to a strong user's script in the side itself, and the
# two profiles say where. AFTER=1 adds the side after a forged block in a fresh process (side_alone --after-forged).
# Carry [".whl"]. Out: $OUT/side_alone_<side>.json (with its profile), $OUT/peers_8b_proxy_gbs8_* (bench_all_sides.sh).
set -u
. scripts/device/setup.sh
SIDE=${SIDE:-torch_compile}
W="$PROXY_GBS8 hardware=h200 train.deterministic=false"
echo "$(ts) == $SIDE alone, fresh process ($(left) s left)"
# shellcheck disable=SC2086  # W is a list of overrides
timeout $(( $(left) - 60 )) python3 experiments/peers/side_alone.py --side "$SIDE" --profile "$OUT/side_alone_$SIDE.json" \
  -- $W 2>&1 | grep -E "^side_alone|^error|^profile|^  [a-zA-Z -]+ +[0-9.]+ ms"
if [ -n "${AFTER:-}" ]; then
  echo "$(ts) == $SIDE after a forged block, fresh process ($(left) s left)"
  timeout $(( $(left) - 60 )) python3 experiments/peers/side_alone.py --side "$SIDE" --after-forged -- $W 2>&1 \
    | grep -E "^side_alone|^error"
fi
echo "$(ts) == the bench: forged, FP8 candidate, $SIDE, each profiled ($(left) s left)"
BUDGET=$(( $(left) - 5 )) AGAINST=$SIDE PROFILE=1 bash experiments/peers/bench_all_sides.sh 2>&1 | grep -vE "wheel|^python "
