#!/usr/bin/env bash
# Device call 5 (one H200): llama1b_h200 (16 layers, seq 4096), the scenario default (grad-accum fusion, one-pass
# optimizer with the sealed Triton AdamW since 2026-12-03) vs the plain torch.compile baseline, sequential A-B-A
# blocks, at a production-like global batch (GBS, default 32 = micro-batch 4 x grad-accum 8) and one micro-batch.
#   run: bash scripts/device/call5_bench1b.sh   (carry [".whl"]); GBS=4 gives the old single-micro-batch headline
set -u
. scripts/device/setup.sh
GBS=${GBS:-32}
echo "$(ts) == bench llama1b_h200, micro-batch 4, GBS $GBS, seq 4096 ($(left) s left)"
timeout $(left) python3 -m forgetrain.bench scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=$GBS \
  train.deterministic=false bench.against=[torch_compile] bench.steps=6 \
  bench.warmup=2 bench.interleave=never bench.out_dir=/tmp/b1b 2>&1 | filt 24
cp /tmp/b1b/bench.json $OUT/call5_bench_llama1b_gbs${GBS}_torch_compile.json 2>/dev/null
echo "$(ts) done"
