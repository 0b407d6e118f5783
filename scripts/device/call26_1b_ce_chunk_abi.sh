#!/usr/bin/env bash
# Device call 26 (one H200), the performance issue, two parts in one call (about 5 min):
#  a. surpass of llama1b_h200's default with kernels.ce_chunk=triton on (0.7% faster in call24ce's A-B-A) at the
#     real shape, against the 5 stored Megatron-core seeds (call10's judge, about 150 s);
#  b. the one-process A/B (setup.sh's abi, bench.candidate) checked against the three-process A-B-A on a lever whose
#     A-B-A is known: the 1B at GBS 16 with swiglu off as the candidate (call24's A-B-A: swiglu on is 1.8% faster).
#   run: bash scripts/device/call26_1b_ce_chunk_abi.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
if [ -z "${SKIP_A:-}" ]; then
  JUDGE=1 BUDGET=$(( $(left) > 330 ? 330 : $(left) )) bash scripts/device/call10_surpass_1b_real.sh 2>&1 \
    | grep -vE "^python |wheel"
  for f in $OUT/call10_fast_default_verdict.json $OUT/call10_fast_default_loss_curves.png; do
    [ -f "$f" ] && mv "$f" "${f/call10_fast_default/call26_1b_ce_chunk_surpass}"
  done
fi
echo "$(ts) == b. abi: 1B GBS 16, default vs candidate swiglu=torch ($(left) s left)"
ABA_W="scenario=llama1b_h200 train.micro_batch_size=4 train.global_batch_size=16" abi call26abi "kernels.swiglu:torch"
echo "$(ts) done"
