#!/usr/bin/env bash
# The 8B proxy beside one general-framework side on one H200: llama8b_h100 (full 8B width, 4 layers, seq 8192),
# micro-batch 1 x grad-accum 8 = global batch 8, the forged engine (the scenario default; LEVERS adds switches)
# side by side with SIDE:
#   torchtitan:    torchtitan 0.3.0 (references/torchtitan: its Llama-3 model, FSDP2 on one rank, compile on);
#   deepspeed:     DeepSpeed 0.19.8 (references/deepspeed), bf16 with fp32 master weights;
#   megatron:      Megatron-core 0.16.1, local spec;
#   torch_compile, torch_compile_autocast: the plain-PyTorch baselines (references/torch_compile*).
# One side per call: each side holds its own fp32 weights and Adam moments (about 30 GB here), so two sides and the
# forged engine together risk running out of memory. Sequential A-B-A blocks (bench.interleave=never).
# If a side cannot run on the device's torch, its one-line error is the result to record.
# torchtitan and deepspeed need the sides' wheels: SIDES=1 bash scripts/device/wheels.sh, then carry
# [".whl", ".whl_sides"].
#   run: SIDE=deepspeed bash experiments/peers/bench_8b_proxy_sides.sh
#   SIDE=megatron LEVERS="engine.fp8=tensorwise" ...: the FP8 forged engine beside Megatron-core
#   SIDE=torch_compile MB=2 ...: both at micro-batch 2 x grad-accum 4 (needs no .whl_sides)
set -u
. scripts/device/setup.sh
side=${SIDE:-torchtitan}
# the forged side runs the scenario default, which carries both levers since 2026-12-03 (gradient accumulation
# fusion, the one-pass optimizer with the sealed Triton AdamW); LEVERS adds switches to it. MB sets the micro-batch
# (default 1; MB=2 is grad-accum 4 at the same global batch 8, the same for every side)
LEVERS=${LEVERS-}
MB=${MB:-1}
[ "$side" = torch_compile ] || \
  python3 -c "import $side; print('$side', $side.__version__ if hasattr($side, '__version__') else '')" 2>&1 | tail -1
echo "$(ts) == bench, llama8b_h100 proxy, GBS 8, forged vs $side ($(left) s left)"
timeout $(left) python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=$MB \
  train.global_batch_size=8 $LEVERS train.deterministic=false "bench.against=[$side]" bench.steps=6 bench.warmup=2 \
  bench.interleave=never parallel.timeout_s=60 bench.out_dir=/tmp/b15 2>&1 | filt 30
cp /tmp/b15/bench.json $OUT/peers_bench_8b_proxy_gbs8_mb${MB}_${side//,/_}.json 2>/dev/null
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
echo "$(ts) done"
