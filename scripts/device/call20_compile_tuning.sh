#!/usr/bin/env bash
# Device call 20 (one H200), the performance issue's engine.compile_tuning lever: inductor's coordinate-descent
# search of each generated kernel's block sizes and warps, for every torch.compile the engine makes. The 8B proxy's
# profile (2026-12-02/03) has the compiled chunked cross-entropy at about 2 TB/s (25.6 ms of a 1.02 s GBS-8 step)
# and the compiled norm kernels below bandwidth.
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, warm-up 2 (the search runs
#      in the first steps), median of 6, the forged engine alone: A the scenario default, B with
#      engine.compile_tuning=coordinate_descent (profiled unless NOPROF=1), A again;
#   4. unless NOTOL=1: the switch's declared tier, tolerance, vs Megatron-core (T of shapes.sh) on the fast base
#      with engine.compile=true (the blocks compiled, so every compile site is tuned); verdict and plot.
#   run: bash scripts/device/call20_compile_tuning.sh   (carry [".whl"]; about 5 min)
set -u
. scripts/device/setup.sh
P="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8 \
train.deterministic=false bench.against=[] bench.steps=6 bench.warmup=2 bench.single_micro_batch=false"
i=0
for arm in A B A; do
  i=$((i+1))
  sw=$([ $arm = B ] && echo "engine.compile_tuning=coordinate_descent \
bench.profile=$([ -z "${NOPROF:-}" ] && echo true || echo false)" || echo "")
  echo "$(ts) == $i. forged alone, arm $arm ${sw:-(scenario default)} ($(left) s left)"
  timeout $(( $(left) - 30 )) python3 -m forgetrain.bench $P $sw bench.out_dir=/tmp/b20_$i 2>&1 \
    | grep -E "^forged |error|^  [a-zA-Z -]+ +[0-9.]+ ms"
  cp /tmp/b20_$i/bench.json $OUT/call20_bench_${i}_$arm.json 2>/dev/null
done
tar czf $OUT/call20_profile_B.tgz -C /tmp/b20_2 profile_forged.json 2>/dev/null
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + engine.compile=true + compile_tuning vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE engine.compile=true \
    engine.compile_tuning=coordinate_descent verify.out_dir=/tmp/v20 2>&1 | filt 4
  cp /tmp/v20/verdict.json $OUT/call20_tol_compile_tuning_verdict.json 2>/dev/null
  cp /tmp/v20/loss_curves.png $OUT/call20_tol_compile_tuning_loss_curves.png 2>/dev/null
fi
echo "$(ts) done"
