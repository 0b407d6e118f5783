#!/usr/bin/env bash
# The 8B proxy's micro-batch on one H200, at the same global batch 8: micro-batch 1 x grad-accum 8 against
# micro-batch MB (default 2) x grad-accum 8/MB. At micro-batch 2 each GEMM has 16384 rows instead of 8192 and the
# fixed cost per micro-batch (weight-gradient accumulation, launch gaps) is paid half as often. Same tokens per
# step, so MFU compares directly; attention is per sequence and unchanged.
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), GBS 8, median of 6, forged alone: A micro-batch 1
#      (the aba helper's workload), B micro-batch MB (profiled unless NOPROF=1), A again. The peak grows by about
#      one micro-batch of activations (about 4.5 GiB at MB 2).
#   No tier check: the micro-batch is a training setting, not an engine switch; Megatron-core is judged at the same
#   split whenever a verify runs at it.
#   run: bash experiments/microbatch/ab_h200.sh   (carry [".whl"]; about 3 min)
set -u
. scripts/device/setup.sh
aba microbatch "train.micro_batch_size=${MB:-2}"
echo "$(ts) done"
