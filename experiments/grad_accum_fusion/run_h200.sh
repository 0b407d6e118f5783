#!/usr/bin/env bash
# Gradient-accumulation fusion (engine.grad_accum_fusion=true, scenarios/llama1b_h200/wgrad.py; declared tier:
# tolerance) and the one-pass optimizer (engine.onepass_optimizer=true with kernels.adamw=triton; tolerance) on one
# H200:
#   PART=a: (1) the tolerance golden at the T shape of scripts/device/shapes.sh (h1024 x 4 layers, 8 steps, bf16,
#           deterministic, micro-batch 2 x grad-accum 2; made per call: too large to bring back), then the switch on
#           the fast base at tolerance, once with the plain LM head and once with the chunked LM-head CE (both head
#           paths); (2) the fast default plus the switch at loss_curve against the stored 5-seed golden at the L
#           shape (h2048 x 8 layers, seq 2048, grad-accum 4, 300 steps); (3) the one-pass optimizer on the fast
#           base at tolerance.                                                                 (~450 s)
#   PART=b: forgetrain.bench on the llama8b_h100 proxy (4 layers, seq 8192) at micro-batch 1 x grad-accum 8, the
#           forged engine alone (bench.against=[]), switch off, on, off again (A-B-A: the two "off" runs bracket
#           the machine's drift), then both levers on; step_s, MFU, memory and the GEMM path it chose (bench.json
#           "engine_info").                                                                    (~550 s)
#   Both levers are in the Hopper scenarios' defaults now, so "off" sets them off explicitly.
# Verdicts travel back as one tar, the bench.json files one each (each file < 16 MiB, <= 8 files in all).
#   run: PART=a bash experiments/grad_accum_fusion/run_h200.sh ; then PART=b ...   (carry [".whl"])
set -u
. scripts/device/setup.sh
PART=${PART:-a}
. scripts/device/shapes.sh   # L, T, BASE, FIVE
GAF="engine.grad_accum_fusion=true"
# the one-pass optimizer with the Triton AdamW (sealed on CUDA now; allow_unsealed kept so the script runs on a
# store without its seal)
ONEPASS="kernels.adamw=triton engine.onepass_optimizer=true kernels.allow_unsealed=true"
B="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8 \
train.deterministic=false bench.against=[] bench.steps=8 bench.warmup=3 bench.interleave=always \
bench.single_micro_batch=false parallel.timeout_s=60"
mkdir -p /tmp/verdicts
judge() {  # name, then the verify overrides
  local name=$1; shift
  echo "$(ts) == $name ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify "$@" verify.out_dir=/tmp/v_$name > /tmp/log_$name 2>&1
  grep -m1 "grad_accum_fusion:" /tmp/log_$name   # the GEMM path the engine probed
  filt 6 < /tmp/log_$name
  cp /tmp/v_$name/verdict.json /tmp/verdicts/gaf_${name}_verdict.json 2>/dev/null
  cp /tmp/v_$name/loss_curves.png /tmp/verdicts/gaf_${name}_loss_curves.png 2>/dev/null
  rm -rf /tmp/v_$name
  tar cf $OUT/gaf_a_verdicts.tar -C /tmp verdicts 2>/dev/null
}
bench() {  # name, then the bench overrides
  local name=$1; shift
  echo "$(ts) == bench $name ($(left) s left)"
  timeout $(left) python3 -m forgetrain.bench $B "$@" bench.out_dir=/tmp/b_$name > /tmp/log_b_$name 2>&1
  grep -E "grad_accum_fusion:|^engine info|^\[block\]" /tmp/log_b_$name
  filt 6 < /tmp/log_b_$name
  cp /tmp/b_$name/bench.json $OUT/gaf_bench_$name.json 2>/dev/null
}
if [ "$PART" = a ]; then
  echo "$(ts) == tolerance golden ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $T verify.make_golden=true verify.out_dir=/tmp/gt 2>&1 | filt 2
  judge tol_gaf $T verify.golden=true $BASE $GAF
  judge tol_gaf_chunked_ce $T verify.golden=true $BASE kernels.cross_entropy=chunked $GAF
  judge tol_onepass $T verify.golden=true $BASE $ONEPASS
  judge gaf_default_5seeds $L tier=loss_curve verify.golden=true $FIVE $GAF
else
  # both levers are in the scenario default now: "off" is the default without either (fused torch AdamW)
  OFF="engine.onepass_optimizer=false kernels.adamw=fused"
  bench off engine.grad_accum_fusion=false $OFF
  bench on $GAF $OFF
  bench onepass $GAF $ONEPASS
  [ "$(left)" -gt 150 ] && bench off2 engine.grad_accum_fusion=false $OFF
fi
df -h /tmp | tail -1
ls -la $OUT
echo "$(ts) done"
