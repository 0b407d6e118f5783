#!/usr/bin/env bash
# Device call 13 (one H200): the forge sandbox (issue 14) on the GPU scenario. A baseline forge round of
# llama1b_h200 at a small shape, target tolerance: the reference's golden, the candidate under the run-time guard
# and the verdict from the traces, each in a process of its own. Checks that honest compiled candidates are not
# rejected by the guard (torch.compile's Inductor/Triton code, the Triton kernels of forgetrain.kernels):
#   1. the fast default (torch.compile, fused AdamW, chunked CE);
#   2. the fast base with every Triton kernel switched on.
# Brings back each run's forge_log.jsonl, ladder_result.json and the tail of its sides.log. (carry [".whl"])
# 2026-12-02: with 320 s left, run 1 was cut off by the timeout before writing its ladder result (no log came back,
# the script then named its outputs call10_*). Give it a call of its own: ONLY=fast_default or ONLY=triton_kernels.
set -u
. scripts/device/setup.sh
S="scenario=llama1b_h200 model.hidden_size=1024 model.num_layers=4 model.num_attention_heads=16 \
model.num_query_groups=4 model.ffn_hidden_size=2816 model.vocab_size=32000 model.seq_length=512 \
train.micro_batch_size=2 train.global_batch_size=4 train.lr_warmup_steps=2 train.precision=bf16 \
train.deterministic=true hardware=h200 parallel.timeout_s=60 forge.max_rounds=0 forge.target_tier=tolerance \
forge.ladder_from=tolerance forge.verify_steps=8"
TRITON="engine.compile=false kernels.rmsnorm=triton kernels.swiglu=triton kernels.rope=triton \
kernels.cross_entropy=triton kernels.adamw=triton kernels.allow_unsealed=true"  # no cuda seals shipped yet
run() {  # name, then the forge overrides
  local name=$1; shift
  echo "$(ts) == $name ($(left) s left)"
  timeout $(left) python3 -m forgetrain.forge $S "$@" forge.out_dir=/tmp/forge_$name hydra.run.dir=/tmp/h_$name \
    2>&1 | filt 8
  cp /tmp/forge_$name/forge_log.jsonl $OUT/call13_${name}_forge_log.jsonl 2>/dev/null
  cp /tmp/forge_$name/rounds/0/ladder_result.json $OUT/call13_${name}_ladder_result.json 2>/dev/null
  tail -c 200000 /tmp/forge_$name/rounds/0/ladder/sides.log > $OUT/call13_${name}_sides.log 2>/dev/null
  [ -f /tmp/forge_$name/rounds/0/ladder_result.json ] || { echo "no ladder result: sides.log tail"; \
    tail -20 /tmp/forge_$name/rounds/0/ladder/sides.log 2>/dev/null; ls -la /tmp/forge_$name /tmp/forge_$name/rounds/0 2>/dev/null; return; }
  python3 - "$name" <<'PY'
import json, sys
r = json.load(open(f"/tmp/forge_{sys.argv[1]}/rounds/0/ladder_result.json"))
print("rejected:", r.get("rejected"), "| error:", r.get("error"), "| wall_s:", round(r.get("wall_s") or 0, 1))
for v in r.get("verdicts", []):
    print(f"  {v['tier']}: {'PASS' if v['passed'] else 'FAIL'} {v['summary'][:150]}")
PY
  grep -E "violation|Error|error" /tmp/forge_$name/rounds/0/ladder/sides.log | grep -v Warning | tail -5
}
[ "${ONLY:-fast_default}" = fast_default ] && run fast_default
[ "${ONLY:-triton_kernels}" = triton_kernels ] && run triton_kernels $TRITON
echo "$(ts) done"
