#!/usr/bin/env bash
# FP8 GEMMs (engine.fp8=tensorwise) beside plain torch.compile (bf16), and their surpass verdicts, on one H200.
# Parts (PARTS, default "c8 c1 s8 s1", about 9 min: run it on a fresh lease, or split it over two calls):
#   c8: side by side, 8B proxy at GBS 8 (micro-batch 1 x grad-accum 8): forged with FP8 vs SIDE (default
#       torch_compile; sequential A-B-A, about 90 s);
#   c1: side by side, llama1b_h200 at GBS 16 (micro-batch 4 x grad-accum 4; GBS=32 for grad-accum 8): forged with
#       FP8 vs SIDE (about 120 s);
#   s8, s1: the surpass verdicts on the 8B proxy and the 1B real shape (experiments/fp8/ab_surpass_h200.sh's parts,
#       about 110 and 150 s).
#   run: bash experiments/fp8/sides_h200.sh   (carry [".whl"]); more than 8 files come back as fp8_sides.tgz
set -u
. scripts/device/setup.sh
for part in ${PARTS:-c8 c1 s8 s1}; do
  case $part in
    c8|c1)
      [ $part = c8 ] && W="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8" \
        || W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=${GBS:-16}"
      echo "$(ts) == $part: forged (engine.fp8=tensorwise) vs ${SIDE:-torch_compile} ($(left) s left)"
      timeout $(( $(left) - 20 )) python3 -m forgetrain.bench $W engine.fp8=tensorwise train.deterministic=false \
        "bench.against=[${SIDE:-torch_compile}]" bench.steps=6 bench.warmup=2 bench.interleave=never parallel.timeout_s=60 \
        bench.out_dir=/tmp/b30$part 2>&1 | filt 30
      cp /tmp/b30$part/bench.json $OUT/fp8_sides_${part}_bench_fp8_${SIDE:-torch_compile}.json 2>/dev/null ;;
    s8|s1) BUDGET=$(left) PARTS=$part TAG=fp8_sides bash experiments/fp8/ab_surpass_h200.sh 2>&1 | grep -v "^python " ;;
  esac
done
pack fp8_sides
echo "$(ts) done"
