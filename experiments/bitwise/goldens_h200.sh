#!/usr/bin/env bash
# Exact mode bitwise on one H200, live and against the stored goldens. The Megatron-core reference runs the
# llama_micro shape (G of scripts/device/shapes.sh) on the GPU in bf16 and fp32 (deterministic), is stored as a
# golden under references/goldens/h200/, and the forged Hopper engine (exact mode) is judged twice: live and against
# the stored golden. Then, with the time left, each Triton kernel is validated on the GPU at full shapes (no bench).
#   run: bash experiments/bitwise/goldens_h200.sh   (carry [".whl"]); brings back $OUT/goldens_h200.tar
# and $OUT/bitwise_json.tgz (every verdict and validation JSON; extract under experiments/bitwise/results/<date>_h200/)
set -u
. scripts/device/setup.sh
ts() { date +%H:%M:%S; }
. scripts/device/shapes.sh   # G
mkdir -p /tmp/c6
for p in bf16 fp32; do
  echo "$(ts) == golden $p: regenerate (live reference vs forged)"
  timeout 60 python3 -m forgetrain.verify $G train.precision=$p verify.regenerate=true verify.out_dir=/tmp/g_$p 2>&1 \
    | grep -vE "Warning|warn" | tail -4
  cp /tmp/g_$p/verdict.json /tmp/c6/golden_regen_$p.json 2>/dev/null
  echo "$(ts) == golden $p: forged vs the stored golden"
  timeout 40 python3 -m forgetrain.verify $G train.precision=$p verify.golden=true verify.out_dir=/tmp/gg_$p 2>&1 \
    | grep -vE "Warning|warn" | tail -3
  cp /tmp/gg_$p/verdict.json /tmp/c6/golden_check_$p.json 2>/dev/null
  tar cf $OUT/goldens_h200.tar references/goldens/h200
done
for k in rmsnorm cross_entropy swiglu rope adamw; do
  echo "$(ts) == kernel $k validate (cuda, full shapes)"
  timeout 25 python3 -m forgetrain.kernels validate --kernel $k --device cuda --shapes full \
    --json /tmp/c6/validate_$k.json 2>&1 | tail -4
done
# one archive: the device returns at most 8 files
tar czf $OUT/bitwise_json.tgz -C /tmp c6
echo "$(ts) done"
