#!/usr/bin/env bash
# Device call 7 (one H200), the surpass issue: the loss-curve golden at the shape (h2048 x 8 layers,
# seq 2048, micro-batch 2, global batch 8, bf16, 300 steps), three Megatron-core seeds, each made in a process of
# its own (no candidate in it); then the fast engine (its own init, now Megatron's) judged against that golden at
# the surpass tier (loss-curve + interleaved A/B timing against a live Megatron-core), then exact mode at the
# loss-curve tier (the diagnostic: init alone vs the fast path). Brings back verdicts, plots and the golden.
#   run: bash scripts/device/call7_surpass_h200.sh   (carry [".whl"])
set -u
. scripts/device/setup.sh
S="scenario=llama1b_h200 model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 \
model.num_query_groups=4 model.ffn_hidden_size=8192 model.vocab_size=32000 model.seq_length=2048 \
train.micro_batch_size=2 train.global_batch_size=8 train.precision=bf16 train.deterministic=false hardware=h200 \
verify.curve_steps=${STEPS:-300} parallel.timeout_s=60"
V="python3 -m forgetrain.verify $S"
for s in ${SEEDS:-1234 1235 1236}; do
  echo "$(ts) == golden seed $s ($(left) s left)"
  timeout $(left) $V tier=loss_curve verify.make_golden=true "verify.seeds=[$s]" verify.out_dir=/tmp/g$s 2>&1 | filt 3
  rm -rf /tmp/g$s
  tar cf $OUT/golden_h200_loss_curve.tar references/goldens/h200 2>/dev/null  # after each seed: a timeout keeps it
done
[ -n "${GOLDEN_ONLY:-}" ] && { echo "$(ts) done (golden only)"; exit 0; }
run_tier() {  # name tier extra-overrides...
  local name=$1 tier=$2; shift 2
  echo "$(ts) == $name: tier=$tier vs the golden ($(left) s left)"
  timeout $(left) $V tier=$tier verify.golden=true verify.out_dir=/tmp/v_$name "$@" 2>&1 | filt 8
  cp /tmp/v_$name/verdict.json $OUT/${name}_verdict.json 2>/dev/null
  cp /tmp/v_$name/loss_curves.png $OUT/${name}_loss_curves.png 2>/dev/null
  rm -rf /tmp/v_$name/candidate
}
run_tier fast_default surpass
run_tier exact loss_curve mode=exact
df -h /tmp | tail -1
echo "$(ts) done"
