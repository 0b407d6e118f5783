#!/usr/bin/env bash
# Device call 23 (one H200), the performance issue: the cross-entropy chunk. The 8B proxy's H200 profile
# (2026-12-03, seventh session, call21_profile_B.tgz) shows inductor's compiled _ce_chunk at 1.56 ms per
# [4096, 128256] bf16 logits chunk, 16 calls and 24.9 ms of a 1.01 s GBS-8 step: about 2 TB/s for its two reads and
# one write (3.15 GB), against about 0.8 ms at the 3.9-4.2 TB/s the SwiGLU kernels reach. And each micro-batch's two
# 4096-token chunks each add their LM-head weight gradient into the fp32 main grad (a read-modify-write of
# 128256 x 4096 fp32, 4.2 GB): the accumulating GEMM takes 6.04 ms against 5.5 ms for the one that overwrites.
#   PART=k (default):
#     0. unless NOSEAL=1: validate + seal ce_chunk on CUDA (full shapes; the registry that comes back,
#        call23_registry.json, replaces forgetrain/kernels/registry.json; then add ce_chunk to CUDA_SEALED in
#        tests/test_kernel_switches.py);
#     1-3. the 8B proxy (llama8b_h100, 4 layers, seq 8192), micro-batch 1 x grad-accum 8, median of 6, forged
#        alone: A the scenario default, B kernels.ce_chunk=triton (profiled unless NOPROF=1: the CE kernel should
#        take about half its 24.9 ms), A again;
#     4. unless NOTOL=1: the declared tier, tolerance, vs Megatron-core (T of shapes.sh): the fast base with
#        kernels.cross_entropy=chunked kernels.ce_chunk=triton.
#   PART=c: A-B-A with B engine.ce_chunk_tokens=8192 (one chunk per micro-batch: one fp32 read-modify-write of the
#        LM head's main grad instead of two, and a [8192, 128256] bf16 logits chunk, 2 GiB more at the peak). No
#        tier check: the chunk size is a setting of kernels.cross_entropy=chunked, whose tolerance verdict at the T
#        shape (1024 tokens a micro-batch, under the 4096 default) already ran with one chunk per micro-batch.
#   run: bash scripts/device/call23_ce_chunk.sh   (carry [".whl"]; about 5 min; PART=c about 3 min)
# Ran 2026-12-03 (eighth session): sealed on CUDA (0.925 ms, 1.36x compiled), A-B-A B 0.4% faster, tolerance pass;
# PART=c 0.3% faster for 1 GiB (not a lever). docs/benchmarks.md.
set -u
. scripts/device/setup.sh
. scripts/device/shapes.sh
case "${PART:-k}" in
k)
  if [ -z "${NOSEAL:-}" ]; then
    echo "$(ts) == 0. validate + seal ce_chunk on CUDA ($(left) s left)"
    timeout 150 python3 -m forgetrain.kernels seal --kernel ce_chunk --device cuda --shapes full --repeats 20 \
      --warmup 5 --registry forgetrain/kernels/registry.json --json $OUT/call23_ce_chunk_seal.json 2>&1 | filt 4
    cp forgetrain/kernels/registry.json $OUT/call23_registry.json
  fi
  aba call23 "kernels.ce_chunk=triton kernels.allow_unsealed=${UNSEALED:-false}"
  if [ -z "${NOTOL:-}" ]; then
    echo "$(ts) == 4. tolerance: fast base + chunked CE + kernels.ce_chunk=triton vs Megatron-core ($(left) s left)"
    timeout $(( $(left) - 10 )) python3 -m forgetrain.verify $T $BASE kernels.cross_entropy=chunked \
      kernels.ce_chunk=triton kernels.allow_unsealed=${UNSEALED:-false} verify.out_dir=/tmp/v23 2>&1 | filt 4
    cp /tmp/v23/verdict.json $OUT/call23_tol_ce_chunk_verdict.json 2>/dev/null
    cp /tmp/v23/loss_curves.png $OUT/call23_tol_ce_chunk_loss_curves.png 2>/dev/null
  fi ;;
c)
  aba call23c "engine.ce_chunk_tokens=8192" ;;
*) echo "error: PART must be k or c, got '${PART}'"; exit 2 ;;
esac
echo "$(ts) done"
