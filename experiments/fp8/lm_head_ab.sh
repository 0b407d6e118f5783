#!/usr/bin/env bash
# What engine.fp8_lm_head buys on top of engine.fp8=tensorwise: an A-B-A of the forged engine alone on the 8B proxy
# at GBS 8 (micro-batch 1 x grad-accum 8; A: engine.fp8=tensorwise, B: the same with the LM head's GEMMs in FP8 too),
# then one profiled bench of each arm (3 steps), for the step's time by category and by kernel.
#   bash experiments/fp8/lm_head_ab.sh      (carry [".whl"]; about 200 s on a warm machine)
# Out: $OUT/fp8head_bench_{1_A,2_B,3_A}.json (bench.json of each arm) and $OUT/fp8head_profile_{A,B}.tgz (each
# arm's bench.json and Chrome trace; the trace stays out of git, its reading goes in the results README).
set -uo pipefail
source scripts/device/setup.sh
ABA_W="$PROXY_GBS8 engine.fp8=tensorwise" NOPROF=1 aba fp8head "engine.fp8_lm_head=true"
for arm in A B; do
  sw=""; [ $arm = B ] && sw="engine.fp8_lm_head=true"
  echo "$(ts) == arm $arm profiled ($(left) s left)"
  timeout $(( $(left) - 15 )) python3 -m forgetrain.bench $PROXY_GBS8 engine.fp8=tensorwise $sw \
    train.deterministic=false bench.against=[] bench.steps=3 bench.warmup=2 bench.single_micro_batch=false \
    bench.profile=true bench.out_dir=/tmp/fp8head_prof_$arm 2>&1 | grep -E "^forged |error|^  [a-zA-Z -]+ +[0-9.]+ ms"
  tar czf "$OUT/fp8head_profile_$arm.tgz" -C /tmp/fp8head_prof_$arm .
done
