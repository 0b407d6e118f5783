#!/usr/bin/env bash
# llama1b_h200 (16 layers, seq 4096) beside plain torch.compile on one H200: the scenario default vs the
# torch_compile side, sequential A-B-A blocks, at a production-like global batch (GBS, default 32 = micro-batch 4 x
# grad-accum 8) and at one micro-batch.
#   run: bash experiments/peers/bench_1b_torch_compile.sh   (carry [".whl"]); SIDE=torch_compile_autocast for the
#   autocast form, GBS=16 for grad-accum 4
set -u
. scripts/device/setup.sh
GBS=${GBS:-32}
echo "$(ts) == bench llama1b_h200, micro-batch 4, GBS $GBS, seq 4096 ($(left) s left)"
timeout $(left) python3 -m forgetrain.bench scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=$GBS \
  train.deterministic=false bench.against=[${SIDE:-torch_compile}] bench.steps=6 \
  bench.warmup=2 bench.interleave=never bench.out_dir=/tmp/b1b 2>&1 | filt 24
cp /tmp/b1b/bench.json $OUT/peers_bench_llama1b_gbs${GBS}_${SIDE:-torch_compile}.json 2>/dev/null
echo "$(ts) done"
