#!/usr/bin/env bash
# Superseded for the SwiGLU lever by call19_swiglu_ab.sh (one-machine A-B-A; the packed backward kernel changed after this call ran).
# Device call 18 (one H200), the performance issue's SwiGLU lever: kernels.swiglu=triton now runs swiglu_packed on
# the fused fc1 output [gate | up], whose backward writes d(fc1) whole (the torch path's compiled, cat-fused SwiGLU
# backward moved its data at about 2 TB/s: 19.1 ms of a 1.03 s GBS-8 step of the 8B proxy, 2026-12-02 profile).
#   1. validate both entry points at the full shapes and seal swiglu on CUDA (forgetrain.kernels seal; the new
#      registry.json comes back: copy it over forgetrain/kernels/registry.json);
#   2. the 8B proxy (llama8b_h100, 4 layers, seq 8192) at GBS 8, micro-batch 1 x grad-accum 8: the scenario default
#      with kernels.swiglu=triton beside torch.compile, sequential A-B-A, with the per-category profile
#      (compare with the default's 1.0237 s, 64.7% MFU PaLM, 2026-12-03);
#   3. unless NOTOL=1: the tolerance tier of the fast base with kernels.swiglu=triton vs Megatron-core
#      (T of shapes.sh: h1024/4L bf16, 8 steps; the switch's declared tier).
#   run: bash scripts/device/call18_swiglu_packed.sh   (carry [".whl"]; about 6 min)
set -u
. scripts/device/setup.sh
echo "$(ts) == 1. validate + seal swiglu on CUDA ($(left) s left)"
timeout 120 python3 -m forgetrain.kernels seal --kernel swiglu --device cuda --shapes full --repeats 20 --warmup 5 \
  --registry forgetrain/kernels/registry.json --json $OUT/call18_swiglu_seal.json 2>&1 | filt 20
cp forgetrain/kernels/registry.json $OUT/call18_registry.json
echo "$(ts) == 2. bench: default + kernels.swiglu=triton vs torch.compile, 8B proxy GBS 8, profiled ($(left) s left)"
timeout $(( $(left) - 150 )) python3 -m forgetrain.bench scenario=llama8b_h100 model.num_layers=4 \
  train.micro_batch_size=1 train.global_batch_size=8 kernels.swiglu=triton kernels.allow_unsealed=true \
  train.deterministic=false "bench.against=[torch_compile]" bench.steps=6 bench.warmup=2 bench.interleave=never \
  bench.profile=true bench.out_dir=/tmp/b18 2>&1 | filt 40
cp /tmp/b18/bench.json $OUT/call18_bench_8b_proxy_gbs8_swiglu_triton.json 2>/dev/null
tar czf $OUT/call18_profiles.tgz -C /tmp/b18 profile_forged.json profile_torch_compile.json 2>/dev/null
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 3. tolerance: fast base + kernels.swiglu=triton vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  # T: the tolerance shape of every switch's GPU tier check (shapes.sh), judged against a Megatron-core run here
  timeout $(left) python3 -m forgetrain.verify $T $BASE kernels.swiglu=triton kernels.allow_unsealed=true \
    verify.out_dir=/tmp/v18 2>&1 | filt 8
  cp /tmp/v18/verdict.json $OUT/call18_tol_swiglu_packed_verdict.json 2>/dev/null
fi
echo "$(ts) done"
