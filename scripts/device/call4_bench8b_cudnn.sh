#!/usr/bin/env bash
# Device call 4 (one H200): llama8b_h100 proxy (4 layers, seq 8192, micro-batch 1), forged fast engine with the
# cuDNN-first SDPA and the single-chunk compiled CE vs the plain torch.compile baseline,
# sequential A-B-A blocks.   run: bash scripts/device/call3_bench8b_fused_ce.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
echo "$(date +%H:%M:%S) == bench llama8b_h100 proxy, mb 1, seq 8192, single-chunk compiled CE"
timeout 360 python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 \
  train.global_batch_size=1 train.deterministic=false engine.ce_chunk_tokens=8192 bench.against=[torch_compile] \
  bench.steps=10 bench.warmup=3 bench.interleave=never bench.out_dir=/tmp/b8d 2>&1 \
  | grep -vE "Warning|warn\(|^\s*$" | tail -12
cp /tmp/b8d/bench.json $OUT/bench_llama8b_mb1_cudnn.json 2>/dev/null
echo "$(date +%H:%M:%S) done"
