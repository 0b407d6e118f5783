#!/usr/bin/env bash
# Device call 30 (one H200), the performance issue's open items with FP8 GEMMs (engine.fp8=tensorwise, its version
# with the transposes in compiled code, main at 78b7c43 or later). Parts (PARTS, default "c8 c1 s8 s1", about
# 9 min: run it on a fresh lease, or split it over two calls):
#   c8: side by side, 8B proxy at GBS 8 (micro-batch 1 x grad-accum 8): forged with FP8 vs plain torch.compile
#       (call15's workload; sequential A-B-A, about 90 s);
#   c1: side by side, llama1b_h200 at GBS 16 (micro-batch 4 x grad-accum 4; GBS=32 for grad-accum 8): forged with
#       FP8 vs plain torch.compile (about 120 s);
#   s8, s1: the surpass verdicts of this version on the 8B proxy and the 1B real shape (call27's parts, about 110
#       and 150 s).
#   run: bash scripts/device/call30_fp8_sides.sh   (carry [".whl"]); more than 8 files come back as call30.tgz
set -u
. scripts/device/setup.sh
for part in ${PARTS:-c8 c1 s8 s1}; do
  case $part in
    c8|c1)
      [ $part = c8 ] && W="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8" \
        || W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=${GBS:-16}"
      echo "$(ts) == $part: forged (engine.fp8=tensorwise) vs torch_compile ($(left) s left)"
      timeout $(( $(left) - 20 )) python3 -m forgetrain.bench $W engine.fp8=tensorwise train.deterministic=false \
        "bench.against=[torch_compile]" bench.steps=6 bench.warmup=2 bench.interleave=never parallel.timeout_s=60 \
        bench.out_dir=/tmp/b30$part 2>&1 | filt 30
      cp /tmp/b30$part/bench.json $OUT/call30_${part}_bench_fp8_torch_compile.json 2>/dev/null ;;
    s8|s1) BUDGET=$(left) PARTS=$part TAG=call30 bash scripts/device/call27_fp8.sh 2>&1 | grep -v "^python " ;;
  esac
done
pack call30
echo "$(ts) done"
