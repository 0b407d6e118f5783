#!/usr/bin/env bash
# The cross-entropy chunk kernel (kernels.ce_chunk=triton: each LM-head chunk's loss and d(logits) by a forged
# Triton kernel instead of inductor's compiled ops) on one H200. Inductor's compiled _ce_chunk runs at about 2 TB/s
# for its two reads and one write of each [4096, 128256] bf16 logits chunk.
#   PART=k (default):
#     0. unless NOSEAL=1: validate + seal ce_chunk on CUDA (full shapes; the registry that comes back,
#        ce_chunk_registry.json, replaces forgetrain/kernels/registry.json; then add ce_chunk to CUDA_SEALED in
#        tests/test_kernel_switches.py);
#     1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, median of 6, forged
#        alone: A the scenario default with kernels.ce_chunk=torch, B kernels.ce_chunk=triton (profiled unless
#        NOPROF=1), A again;
#     4. unless NOTOL=1: the declared tier, tolerance, vs Megatron-core (T of shapes.sh): the fast base with
#        kernels.cross_entropy=chunked kernels.ce_chunk=triton.
#   PART=c: A-B-A with B engine.ce_chunk_tokens=8192 (one chunk per micro-batch: one fp32 read-modify-write of the
#        LM head's main grad instead of two, and a [8192, 128256] bf16 logits chunk, 2 GiB more at the peak). No
#        tier check: the chunk size is a setting of kernels.cross_entropy=chunked, whose tolerance verdict at the T
#        shape (1024 tokens a micro-batch, under the 4096 default) already ran with one chunk per micro-batch.
#   run: bash experiments/ce_chunk/ab_h200.sh   (carry [".whl"]; about 5 min; PART=c about 3 min)
set -u
. scripts/device/setup.sh
. scripts/device/shapes.sh
case "${PART:-k}" in
k)
  if [ -z "${NOSEAL:-}" ]; then
    echo "$(ts) == 0. validate + seal ce_chunk on CUDA ($(left) s left)"
    timeout 150 python3 -m forgetrain.kernels seal --kernel ce_chunk --device cuda --shapes full --repeats 20 \
      --warmup 5 --registry forgetrain/kernels/registry.json --json $OUT/ce_chunk_seal.json 2>&1 | filt 4
    cp forgetrain/kernels/registry.json $OUT/ce_chunk_registry.json
  fi
  ABA_A=${ABA_A-kernels.ce_chunk=torch} aba ce_chunk "kernels.ce_chunk=triton kernels.allow_unsealed=${UNSEALED:-false}"
  if [ -z "${NOTOL:-}" ]; then
    echo "$(ts) == 4. tolerance: fast base + chunked CE + kernels.ce_chunk=triton vs Megatron-core ($(left) s left)"
    timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE kernels.cross_entropy=chunked \
      kernels.ce_chunk=triton kernels.allow_unsealed=${UNSEALED:-false} verify.out_dir=/tmp/v23 2>&1 | filt 4
    cp /tmp/v23/verdict.json $OUT/tol_ce_chunk_verdict.json 2>/dev/null
    cp /tmp/v23/loss_curves.png $OUT/tol_ce_chunk_loss_curves.png 2>/dev/null
  fi ;;
c)
  aba ce_chunk_tokens "engine.ce_chunk_tokens=8192" ;;
*) echo "error: PART must be k or c, got '${PART}'"; exit 2 ;;
esac
echo "$(ts) done"
