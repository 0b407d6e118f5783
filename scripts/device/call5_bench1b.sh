#!/usr/bin/env bash
# Device call 5 (one H200): llama1b_h200 (16 layers, seq 4096, micro-batch 4), forged fast engine vs the plain
# torch.compile baseline, sequential A-B-A blocks.   run: bash scripts/device/call5_bench1b.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
echo "$(date +%H:%M:%S) == bench llama1b_h200, mb 4, seq 4096"
timeout 240 python3 -m forgetrain.bench scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=4 \
  train.deterministic=false engine.ce_chunk_tokens=16384 bench.against=[torch_compile] bench.steps=10 \
  bench.warmup=3 bench.interleave=never bench.out_dir=/tmp/b1b 2>&1 | grep -vE "Warning|warn\(|^\s*$" | tail -12
cp /tmp/b1b/bench.json $OUT/bench_llama1b_mb4.json 2>/dev/null
echo "$(date +%H:%M:%S) done"
