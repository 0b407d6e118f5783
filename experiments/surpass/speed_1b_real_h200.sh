#!/usr/bin/env bash
# The speed half of the surpass tier at the 1B real shape (R1B of scripts/device/shapes.sh), alone: the forged
# default beside Megatron-core (local spec, no Transformer Engine) and the strongest bf16 peer (`torch_compile`,
# conf/tier/surpass.yaml `peers`), timed by the bench the way verify's surpass times them (interleaved where they
# fit, else A-B-A blocks), at the shape's global batch 4 (micro-batch 2 x grad-accum 2, the golden's) and at one
# micro-batch. The loss-curve half is the paired verdict of docs/equivalence_power.md at the same shape; the full
# verdict is `JUDGE=1 bash experiments/surpass/llama1b_real_h200.sh`.
#   run: bash experiments/surpass/speed_1b_real_h200.sh   (carry [".whl"]; about 250 s)
set -u
. scripts/device/setup.sh
. scripts/device/shapes.sh   # R1B
echo "$(ts) == bench R1B: forged vs megatron, torch_compile ($(left) s left)"
timeout $(( $(left) - 10 )) python3 -m forgetrain.bench ${R1B/verify.curve_steps=300/} train.deterministic=false \
  bench.against=[megatron,torch_compile] bench.steps=${STEPS:-10} bench.warmup=2 bench.out_dir=/tmp/s1b 2>&1 | filt 30
cp /tmp/s1b/bench.json $OUT/surpass_speed_1b_real_bench.json 2>/dev/null
echo "$(ts) done"
