#!/usr/bin/env bash
# A-B-A of one lever on llama1b_h200 at its real shape (Llama-3.2-1B width, 16 layers, seq 4096, V 128256) and a
# production-like batch, micro-batch 4 x grad-accum 4 (GBS 16), forged alone, median of 6, on one H200: A the
# scenario default plus ABA_A, B the scenario default plus the B overrides (default kernels.swiglu=triton; profiled
# unless NOPROF=1), A again. Both Triton kernels are in llama1b_h200's default now, so with B unset ABA_A defaults
# to kernels.swiglu=torch; B=kernels.ce_chunk=triton ABA_A=kernels.ce_chunk=torch gives the CE-chunk row
# (experiments/ce_chunk/README.md). TAG names the files (default swiglu_1b). No tier check: each kernel's declared
# tier (tolerance) was judged at the T shape, which is the 1B scenario's own engine.
#   run: bash experiments/swiglu/ab_llama1b_h200.sh   (carry [".whl"]; about 4 min)
set -u
. scripts/device/setup.sh
[ -z "${B:-}" ] && ABA_A=${ABA_A-kernels.swiglu=torch}
ABA_A=${ABA_A:-} ABA_W="scenario=llama1b_h200 hardware=h200 train.micro_batch_size=4 train.global_batch_size=16" \
  aba ${TAG:-swiglu_1b} "${B:-kernels.swiglu=triton} ${EXTRA_B:-}"
echo "$(ts) done"
