#!/usr/bin/env bash
# engine.compile_tuning=coordinate_descent on one H200: inductor's coordinate-descent search of each generated
# kernel's block sizes and warps, for every torch.compile the engine makes.
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, warm-up 2 (the search runs
#      in the first steps), median of 6, the forged engine alone: A the scenario default, B with
#      engine.compile_tuning=coordinate_descent (profiled unless NOPROF=1), A again;
#   4. unless NOTOL=1: the switch's declared tier, tolerance, vs Megatron-core (T of shapes.sh) on the fast base
#      with engine.compile=true (the blocks compiled, so every compile site is tuned); verdict and plot.
#   run: bash experiments/compile_tuning/ab_h200.sh   (carry [".whl"]; about 5 min)
set -u
. scripts/device/setup.sh
aba compile_tuning "engine.compile_tuning=coordinate_descent"
if [ -z "${NOTOL:-}" ]; then
  echo "$(ts) == 4. tolerance: fast base + engine.compile=true + compile_tuning vs Megatron-core ($(left) s left)"
  . scripts/device/shapes.sh
  timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE engine.compile=true \
    engine.compile_tuning=coordinate_descent verify.out_dir=/tmp/v20 2>&1 | filt 4
  cp /tmp/v20/verdict.json $OUT/tol_compile_tuning_verdict.json 2>/dev/null
  cp /tmp/v20/loss_curves.png $OUT/tol_compile_tuning_loss_curves.png 2>/dev/null
fi
echo "$(ts) done"
