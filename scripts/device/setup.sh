#!/usr/bin/env bash
# Sourced at the start of every device call: installs the carried wheels (.whl, filled by
# scripts/device/wheels.sh; .whl_sides too where a call carries it) into /tmp/site and points PYTHONPATH at them and the repo. Keeps NVLink multicast off.
T0=$(date +%s)  # the call's clock starts before the install, so BUDGET bounds the whole command (the device's limit is 600 s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl_sides/*.whl 2>/dev/null) \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FORGETRAIN_CACHE=/tmp/ftcache WANDB_MODE=offline
mkdir -p "$OUT"
python3 - <<'PY'
import torch, triton, sys
print(f"python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} "
      f"gpu {torch.cuda.get_device_name()} cuda {torch.version.cuda}")
PY
# Helpers for the call scripts: a timestamp, the seconds left of the call's BUDGET (default 585 s), and a filter
# that drops warnings and blank lines and keeps the last N lines of a command's output.
ts() { date +%H:%M:%S; }
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - T0) )); }
filt() { grep -vE "Warning|warn|^\s*$" | tail -${1:-6}; }
# A-B-A of the forged engine alone on the 8B proxy (llama8b_h100, 4 layers, seq 8192) at GBS 8, micro-batch 1 x
# grad-accum 8, warm-up 2, median of 6, headline only: `aba TAG "B overrides"` times A (the scenario default, plus
# ABA_A's overrides where set: a lever already in the default is timed with ABA_A switching it off), B (the
# scenario default plus the B overrides; profiled unless NOPROF=1), A again; bench.json of each to
# $OUT/TAG_bench_<i>_<arm>.json, B's profile to $OUT/TAG_profile_B.tgz. ABA_W replaces the workload (the part
# before the bench settings), e.g. the 1B real shape at GBS 16:
# ABA_W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=16".
PROXY_GBS8="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=8"  # the 8B proxy at GBS 8: aba's and abi's default workload
aba() {
  local tag=$1 b=$2 i=0 arm sw
  local w=${ABA_W:-$PROXY_GBS8}
  local p="$w train.deterministic=false bench.against=[] bench.steps=6 bench.warmup=2 bench.single_micro_batch=false"
  for arm in A B A; do
    i=$((i+1))
    sw=$([ $arm = B ] && echo "$b bench.profile=$([ -z "${NOPROF:-}" ] && echo true || echo false)" || echo "${ABA_A:-}")
    echo "$(ts) == $i. forged alone, arm $arm ${sw:-(scenario default)} ($(left) s left)"
    timeout $(( $(left) - 30 )) python3 -m forgetrain.bench $p $sw bench.out_dir=/tmp/${tag}_$i 2>&1 \
      | grep -E "^forged |error|^  [a-zA-Z -]+ +[0-9.]+ ms"
    cp /tmp/${tag}_$i/bench.json $OUT/${tag}_bench_${i}_$arm.json 2>/dev/null
  done
  tar czf $OUT/${tag}_profile_B.tgz -C /tmp/${tag}_2 profile_forged.json 2>/dev/null
}
# The same A/B in one process (bench.candidate): `abi TAG "k:v,k:v"` times the forged default and the candidate with
# those engine.*/kernels.* values interleaved step by step (bench.interleave=always: both engines in memory,
# 2 x 40 GiB on the 8B proxy), one build of each and one process instead of three; bench.json to
# $OUT/TAG_bench_AB.json. On the 1B's SwiGLU kernel it agreed in direction with aba (experiments/swiglu/README.md).
abi() {
  local tag=$1 c=$2
  local w=${ABA_W:-$PROXY_GBS8}
  echo "$(ts) == forged vs candidate {$c}, interleaved ($(left) s left)"
  timeout $(( $(left) - 30 )) python3 -m forgetrain.bench $w train.deterministic=false bench.against=[] bench.steps=6 \
    bench.warmup=2 bench.single_micro_batch=false bench.interleave=always "bench.candidate={$c}" \
    bench.out_dir=/tmp/${tag}_ab 2>&1 | grep -E "^(forged|candidate) |error"
  cp /tmp/${tag}_ab/bench.json $OUT/${tag}_bench_AB.json 2>/dev/null
}
# The device returns at most 8 files from $OUT: `pack NAME` folds everything there into $OUT/NAME.tgz when there are
# more (extract it here with `tar xzf NAME.tgz -C experiments/<topic>/results/<date>_h200/`).
pack() {
  [ "$(ls "$OUT" | wc -l)" -le 8 ] && return 0
  tar czf /tmp/$1.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/$1.tgz "$OUT/"
}
