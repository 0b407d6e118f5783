#!/usr/bin/env bash
# Device call 2 (one H200): the bf16 bitwise gate on the GPU (after the RoPE inv_freq fix), then the
# llama8b_h100 proxy (4 layers, full width, seq 8192, micro-batch 1) forged vs torch.compile vs Megatron-core,
# sequential A-B-A blocks (one engine in memory at a time). Each block prints as soon as it is timed.
#   run: bash scripts/device/call2_verify_bench8b.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
ts() { date +%H:%M:%S; }
SMALL="model.hidden_size=1024 model.num_layers=4 model.num_attention_heads=16 model.num_query_groups=4 \
model.ffn_hidden_size=2816 model.vocab_size=32000 model.seq_length=512 train.micro_batch_size=2 \
train.global_batch_size=4 train.lr_warmup_steps=2 hardware=h200"
EXACT="mode=exact train.deterministic=true"
echo "$(ts) == verify bitwise, GPU, bf16, exact mode"
timeout 150 python3 -m forgetrain.verify scenario=llama1b_h200 $SMALL $EXACT train.precision=bf16 tier=bitwise \
  verify.steps=4 verify.out_dir=/tmp/v_bf16 2>&1 | grep -vE "Warning|warn" | tail -5
cp /tmp/v_bf16/verdict.json $OUT/verify_bitwise_gpu_bf16.json 2>/dev/null
echo "$(ts) == bench llama8b_h100 proxy, mb 1, seq 8192"
timeout 400 python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 \
  train.global_batch_size=1 train.deterministic=false bench.against=[torch_compile,megatron] bench.steps=10 \
  bench.warmup=3 bench.interleave=never bench.out_dir=/tmp/b8 2>&1 | grep -vE "Warning|warn\(|^\s*$" | tail -16
cp /tmp/b8/bench.json $OUT/bench_llama8b_mb1.json 2>/dev/null
echo "$(ts) done"
