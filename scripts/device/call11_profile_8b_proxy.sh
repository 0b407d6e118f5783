#!/usr/bin/env bash
# Device call 11 (one H200), the performance issue's starting profile at the production-like batch: the
# llama8b_h100 proxy (full 8B width, 4 layers, seq 8192), micro-batch 1 x grad-accum 8 = global batch 8, forged
# fast engine vs plain torch.compile (torchtitan and DeepSpeed are timed in call 15, with .whl_sides), sequential
# A-B-A blocks, with one profiled untimed step per side (bench.profile=true: per-category table in bench.json,
# Chrome traces beside it; the traces travel back compressed). The single-micro-batch row is timed too.
# Expect about 450 s.     run: bash scripts/device/call11_profile_8b_proxy.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
echo "$(ts) == bench + profile, llama8b_h100 proxy, GBS 8 ($(left) s left)"
timeout $(left) python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 \
  train.global_batch_size=8 train.deterministic=false bench.against=[torch_compile] bench.steps=6 \
  bench.warmup=2 bench.interleave=never bench.profile=true parallel.timeout_s=60 bench.out_dir=/tmp/b11 2>&1 \
  | filt 40
cp /tmp/b11/bench.json $OUT/call11_bench_8b_proxy_gbs8.json 2>/dev/null
tar czf $OUT/call11_profiles.tgz -C /tmp/b11 $(cd /tmp/b11 && ls profile_*.json 2>/dev/null) 2>/dev/null
ls -la $OUT
echo "$(ts) done"
