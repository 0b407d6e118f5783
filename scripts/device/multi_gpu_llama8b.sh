#!/usr/bin/env bash
# Issue 8 (NOT RUN: needs kind nvidia-h200-x8, which was not lent on 2026-11-29). What it would run, in one call:
#   run(kind="nvidia-h200-x8", carry=[".whl"], command="bash scripts/device/multi_gpu_llama8b.sh")
# 1. bitwise: forged exact vs Megatron-core, llama8b_h100 full depth (32 layers), seq 8192, bf16, DP=8, 8 steps,
#    deterministic (forgetrain.verify under torchrun; every rank runs both sides, rank 0 writes the verdict);
# 2. the same with TP=2 x DP=4 (parallel=tp2dp4);
# 3. surpass timing: forged fast vs Megatron-core, DP=8 (forgetrain.bench under torchrun, rank 0 reports).
# Prerequisites still open: forgetrain.bench is single-process today (it must time under torchrun and reduce
# step times across ranks); the forged Hopper engine's DP/TP paths come from issue 5's llama_tiny_cpu DP work.
set -u
. scripts/device/setup.sh
export NCCL_NVLS_ENABLE=0
EXACT="engine.mode=exact engine.compile=false kernels.cross_entropy=torch kernels.adamw=torch train.deterministic=true"
torchrun --nproc-per-node 8 -m forgetrain.verify scenario=llama8b_h100 $EXACT parallel.data_parallel_size=8 \
  train.micro_batch_size=1 train.global_batch_size=8 tier=bitwise verify.steps=8 verify.out_dir=/tmp/v8 \
  2>&1 | tail -8
cp /tmp/v8/verdict.json $OUT/verify_bitwise_8gpu_dp8.json 2>/dev/null
torchrun --nproc-per-node 8 -m forgetrain.verify scenario=llama8b_h100 $EXACT parallel.data_parallel_size=4 \
  parallel.tensor_parallel_size=2 train.micro_batch_size=1 train.global_batch_size=4 tier=bitwise verify.steps=8 \
  verify.out_dir=/tmp/v8tp 2>&1 | tail -8
cp /tmp/v8tp/verdict.json $OUT/verify_bitwise_8gpu_tp2dp4.json 2>/dev/null
torchrun --nproc-per-node 8 -m forgetrain.bench scenario=llama8b_h100 parallel.data_parallel_size=8 \
  train.micro_batch_size=1 train.global_batch_size=8 bench.against=[megatron] bench.out_dir=/tmp/b8x8 2>&1 | tail -12
cp /tmp/b8x8/bench.json $OUT/bench_llama8b_8gpu.json 2>/dev/null
