#!/usr/bin/env bash
# Device call 22 (one H200), the performance issue: the 8B proxy's micro-batch. Every 8B-proxy row so far ran
# micro-batch 1 x grad-accum 8 at GBS 8; the profile charges about 14 ms per micro-batch of fixed cost
# (weight-gradient accumulation, launch gaps), and at micro-batch 2 each GEMM has 16384 rows instead of 8192.
# Same global batch, same tokens per step, so MFU compares directly; attention is per sequence and unchanged.
#   1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), GBS 8, median of 6, forged alone: A micro-batch 1 x
#      grad-accum 8 (the default of the aba helper), B micro-batch MB (default 2) x grad-accum 8/MB (profiled unless
#      NOPROF=1), A again. The peak grows by about one micro-batch of activations (about 4.5 GiB at MB 2).
#   No tier check in this call: the micro-batch is a training setting, not an engine switch (llama8b_h100's own
#   default is micro-batch 2); Megatron-core is judged at the same split whenever a verify runs at it.
#   run: bash scripts/device/call22_microbatch.sh   (carry [".whl"]; about 3 min)
set -u
. scripts/device/setup.sh
aba call22 "train.micro_batch_size=${MB:-2}"
echo "$(ts) done"
