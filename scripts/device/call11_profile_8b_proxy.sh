#!/usr/bin/env bash
# Device call 11 (one H200), the performance issue's starting profile at the production-like batch: the
# llama8b_h100 proxy (full 8B width, 4 layers, seq 8192), micro-batch 1 x grad-accum 8 = global batch 8, forged
# fast engine vs plain torch.compile (torchtitan and DeepSpeed are timed in call 15, with .whl_sides), sequential
# A-B-A blocks, with one profiled untimed step per side (bench.profile=true: per-category table in bench.json,
# Chrome traces beside it; the traces travel back compressed). The single-micro-batch row is timed too.
# Expect about 450 s.     run: bash scripts/device/call11_profile_8b_proxy.sh ; SHAPE=1b ...  (carry [".whl"])
# 2026-12-02: gradient-accumulation fusion and the one-pass optimizer passed their tiers on the GPU (call12), so
# the forged side now runs with both (LEVERS; LEVERS= for the scenario default alone). SHAPE=1b times the issue's
# second workload instead: llama1b_h200 at its real shape (16 layers, seq 4096), micro-batch 4 x grad-accum 8 (global batch 32; the house headline needs grad-accum >= 8).
set -u
. scripts/device/setup.sh
LEVERS=${LEVERS-"engine.grad_accum_fusion=true kernels.adamw=triton engine.onepass_optimizer=true kernels.allow_unsealed=true"}
case "${SHAPE:-8b}" in
  8b) W="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8"; tag=8b_proxy_gbs8 ;;
  1b) W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=32"; tag=1b_gbs32 ;;
  *) echo "error: SHAPE must be 8b or 1b"; exit 2 ;;
esac
echo "$(ts) == bench + profile, $tag, forged with [$LEVERS] ($(left) s left)"
timeout $(left) python3 -m forgetrain.bench $W $LEVERS train.deterministic=false bench.against=[torch_compile] \
  bench.steps=6 bench.warmup=2 bench.interleave=never bench.profile=true parallel.timeout_s=60 \
  bench.out_dir=/tmp/b11 2>&1 | filt 40
cp /tmp/b11/bench.json $OUT/call11_bench_$tag.json 2>/dev/null
tar czf $OUT/call11_profiles_$tag.tgz -C /tmp/b11 $(cd /tmp/b11 && ls profile_*.json 2>/dev/null) 2>/dev/null
ls -la $OUT
echo "$(ts) done"
