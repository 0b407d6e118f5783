#!/usr/bin/env bash
# DeepSpeed ZeRO-Offload as the bench's general-framework side on one H200 (references/deepspeed: ZeRO stage 2,
# offload_optimizer cpu with pinned memory, DeepSpeed's CPU Adam, bf16 with fp32 master weights, HF Llama with SDPA
# attention as a bench side, HF activation checkpointing where the config asks for recompute).
# The reference runs that variant whenever the run config offloads (engine.optimizer_offload_fraction > 0), which
# llama8b_h200's default does, so the forged default and DeepSpeed keep their optimizer state on the host alike.
# One part per call:
#   PART=a  the 8B proxy shape (shapes.sh's P8: full 8B width, 4 layers, seq 8192, micro-batch 1) under
#           llama8b_h200's default layout at global batch 8 (grad-accum 8), A-B-A beside deepspeed, warm-up 1,
#           median of 4. DeepSpeed's host need there is 35.3 GiB (references/deepspeed/engine.py,
#           zero_offload_host_parts). First the cpu_adam op is JIT-built (g++ and ninja from the image) so its build
#           time shows on its own and the bench loads it from the cache. Estimate: op build 1-2 min, bench 4-5 min;
#           6-7 min in all. SINGLE=1 adds the one-micro-batch rows, about 3 min more: past one call's 585 s with the
#           op build, so only on a machine still warm from PART=a (the op cached under ~/.cache/torch_extensions).
#   PART=b  scenario=llama8b_h200 at its default (full depth, global batch 32, offload) beside deepspeed: DeepSpeed's
#           ZeRO-Offload needs ~140.8 GiB of host memory (fp32 master + fp32 grads + Adam m and v + a bf16 copy,
#           18 B/param, pinned buffers rounded up), more than the machine's 128 GiB, so the expected result is the
#           one line "deepspeed: cannot run here: needs ~140.8 GiB ..." (not timed), printed after the forged side's
#           first block. About 5-6 min.
# Carry [".whl", ".whl_sides"]: .whl (scripts/device/wheels.sh) and .whl_sides (SIDES=1 bash scripts/device/wheels.sh:
# DeepSpeed 0.19.8 as a pure-Python wheel and its pure-Python deps). ninja and a C++ compiler for the cpu_adam op
# come with the device image, so .whl_sides carries no ninja; the script prints both before building.
# transformers is the image's own (printed too).
#   run: PART=b bash experiments/peers/deepspeed_offload_h200.sh
set -u
. scripts/device/setup.sh
S="scenario=llama8b_h200 hardware=h200 parallel.timeout_s=60"
PROXY="model.num_layers=4 train.micro_batch_size=1"   # shapes.sh P8's shape (the scenario's model is Llama-3-8B)
SMB=false; [ -n "${SINGLE:-}" ] && SMB=true
B="bench.interleave=never train.deterministic=false bench.single_micro_batch=$SMB"
python3 - <<'PY' 2>&1 | filt 4
import os, shutil, subprocess
import deepspeed, transformers
ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
ninja = shutil.which("ninja")
cxx = shutil.which(os.environ.get("CXX", "c++"))
ver = lambda c: subprocess.run([c, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if c else "-"
print(f"deepspeed {deepspeed.__version__} transformers {transformers.__version__} host memory {ram:.1f} GiB "
      f"ninja {ninja} ({ver(ninja)}) c++ {cxx} ({ver(cxx)})")
PY
# host memory in use, sampled every 2 s while the bench runs (the lowest MemAvailable gives the peak need)
sample() { while sleep 2; do awk '/MemAvailable/ {print $2}' /proc/meminfo; done > /tmp/memavail17 & SAMPLER=$!; }
peak() {
  kill $SAMPLER 2>/dev/null
  awk -v t="$(awk '/MemTotal/ {print $2}' /proc/meminfo)" 'NR == 1 || $1 < m {m = $1}
    END {printf "host memory: lowest available %.1f GiB of %.1f GiB (in use at most %.1f GiB)\n",
         m/2^20, t/2^20, (t-m)/2^20}' /tmp/memavail17
}
case "${PART:-a}" in
a)
  echo "$(ts) == DeepSpeed cpu_adam op: JIT build ($(left) s left)"
  t0=$(date +%s)
  DS_ACCELERATOR=cuda timeout $(left) python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; \
CPUAdamBuilder().load(); print('cpu_adam loaded')" 2>&1 | filt 4
  echo "cpu_adam build $(( $(date +%s) - t0 )) s"
  echo "$(ts) == bench: 8B proxy (4 layers), llama8b_h200 default (offload), GBS 8, vs deepspeed ($(left) s left)"
  sample
  timeout $(left) python3 -m forgetrain.bench $S $PROXY train.global_batch_size=8 "bench.against=[deepspeed]" \
    bench.steps=4 bench.warmup=1 $B bench.out_dir=/tmp/b17a 2>&1 | filt 30
  peak
  cp /tmp/b17a/bench.json $OUT/peers_bench_8b_proxy_gbs8_deepspeed_offload.json 2>/dev/null
  ;;
b)
  echo "$(ts) == bench: llama8b_h200 default (GBS 32, offload) vs deepspeed ($(left) s left)"
  sample
  timeout $(left) python3 -m forgetrain.bench $S "bench.against=[deepspeed]" bench.steps=3 bench.warmup=1 $B \
    bench.out_dir=/tmp/b17b 2>&1 | filt 30
  peak
  cp /tmp/b17b/bench.json $OUT/peers_bench_llama8b_h200_gbs32_deepspeed_offload.json 2>/dev/null
  ;;
esac
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
echo "$(ts) done"
