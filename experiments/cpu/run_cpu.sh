#!/usr/bin/env bash
# The CPU numbers of docs/benchmarks.md on this 2-core machine, each the product's own command:
#   train  the llama_tiny_cpu default run (5.0M parameters, seq 128, global batch 16); its summary prints the
#          median-step tokens/s and step time
#   peak   the measured CPU fp32 matmul peak that CPU MFU divides by, measured again (not the cached value)
#   dp2    forgetrain.bench under torchrun, DP=2 on gloo with one thread per rank, llama_micro, beside
#          Megatron-core: a check that the distributed bench runs, not a speed claim
# Numbers on a shared 2-core box move by +-20% with other load; run on an idle machine.
#   run: bash experiments/cpu/run_cpu.sh [train|peak|dp2|all]   (from the repo root, with the package installed)
set -eu
what=${1:-all}
if [ "$what" = train ] || [ "$what" = all ]; then
  python -m forgetrain
fi
if [ "$what" = peak ] || [ "$what" = all ]; then
  FORGETRAIN_REMEASURE_PEAK=1 python -c "from forgetrain.metrics import measured_cpu_peak_flops as m; print(m())"
fi
if [ "$what" = dp2 ] || [ "$what" = all ]; then
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m forgetrain.bench model=llama_micro train.micro_batch_size=2 \
    train.lr_warmup_steps=1 bench.steps=2 bench.warmup=1 "bench.against=[megatron]" train.threads=1 parallel=dp2 \
    train.global_batch_size=8
fi
