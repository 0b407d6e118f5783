#!/usr/bin/env bash
# Device call 1 (one H200): bitwise gates on the GPU, then the llama8b_h100 proxy benchmark.
#   run: bash scripts/device/call1_verify_bench8b.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
SMALL="model.hidden_size=1024 model.num_layers=4 model.num_attention_heads=16 model.num_query_groups=4 \
model.ffn_hidden_size=2816 model.vocab_size=32000 model.seq_length=512 train.micro_batch_size=2 \
train.global_batch_size=4 train.lr_warmup_steps=2 hardware=h200"
EXACT="mode=exact train.deterministic=true"
for prec in bf16 fp32; do
  echo "== verify bitwise, GPU, $prec, exact mode"
  timeout 240 python3 -m forgetrain.verify scenario=llama1b_h200 $SMALL $EXACT train.precision=$prec tier=bitwise \
    verify.steps=4 verify.out_dir=/tmp/v_$prec 2>&1 | grep -vE "Warning|warn" | tail -6
  cp /tmp/v_$prec/verdict.json $OUT/verify_bitwise_gpu_$prec.json 2>/dev/null
done
echo "== bench llama8b_h100 proxy (4 layers, seq 8192), mb 1, vs megatron and torch_compile"
timeout 420 python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 \
  train.global_batch_size=1 train.deterministic=false bench.against=[megatron,torch_compile] bench.steps=10 \
  bench.warmup=3 bench.out_dir=/tmp/b8 2>&1 | grep -vE "Warning|warn\(" | tail -14
cp /tmp/b8/bench.json $OUT/bench_llama8b_mb1.json 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
