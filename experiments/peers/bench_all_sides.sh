#!/usr/bin/env bash
# The bench's sides side by side on one H200 in one call (about 6 to 8 of its 9 minutes): the 8B proxy
# (llama8b_h100: full 8B width, 4 layers, seq 8192) at global batch 8 (micro-batch 1 x grad-accum 8), and at one
# micro-batch per step beside it, under bench.interleave=once (one block per side: each side is built once, timed at
# both batches and freed before the next is built, so the five sides of about 40 GiB each never share the GPU):
#   forged                     the scenario default (bf16 with fp32 main weights, its levers and Triton kernels)
#   candidate                  the same forged engine with engine.fp8=tensorwise (bench.candidate)
#   torch_compile              the strong plain-PyTorch script: bf16 params + fp32 masters, fused QKV and gate/up,
#                              SDPA, fused AdamW, torch.compile of the whole model (references/torch_compile)
#   torchao_float8_tensorwise  that script with torchao 0.17 float8 training (tensorwise) on the decoder linears
#   torchao_float8_rowwise     the same, rowwise
# MFU is printed under both conventions (PaLM; Megatron-LM causal), against the bf16 dense peak for every side.
# Needs the wheels of scripts/device/wheels.sh (torchao is among them): carry [".whl"]. Where torchao is missing on
# the device its two sides are left out with one line and the others run.
#   run:   bash experiments/peers/bench_all_sides.sh        (AGAINST=a,b replaces the reference sides; STEPS, WARMUP)
#   CANDIDATE='{engine.fp8:tensorwise,engine.fp8_lm_head:true}' times another FP8 candidate in the same call
#   PROFILE=1 adds one profiled step per side (bench.profile=true), its traces to $OUT/..._profiles.tgz
#   check: DRY=1 bash experiments/peers/bench_all_sides.sh  prints the bench's overrides, one a line, and exits
#          (tests/test_peers.py composes and validates them on CPU)
# Out: $OUT/peers_8b_proxy_gbs8_bench.json (written after every side's block: a call cut short keeps what was timed)
# and $OUT/peers_8b_proxy_gbs8.log; the last lines are a short table of both row sets.
set -u
if [ -n "${DRY:-}" ]; then
  eval "$(grep '^PROXY_GBS8=' scripts/device/setup.sh)"  # the workload only: no wheel install, no GPU
else
  . scripts/device/setup.sh
fi
CANDIDATE=${CANDIDATE:-"{engine.fp8:tensorwise}"}
AGAINST=${AGAINST:-torch_compile,torchao_float8_tensorwise,torchao_float8_rowwise}
if [ -z "${DRY:-}" ] && ! python3 -c "import torchao" >/dev/null 2>&1; then
  echo "torchao is not installed here (scripts/device/wheels.sh puts it in .whl): its sides are left out"
  AGAINST=$(echo "$AGAINST" | tr ',' '\n' | grep -v '^torchao_' | paste -sd, -)
fi
# shellcheck disable=SC2206  # PROXY_GBS8 is a list of overrides, split on purpose
ARGS=($PROXY_GBS8 hardware=h200 train.deterministic=false "bench.against=[$AGAINST]"
      "bench.candidate=$CANDIDATE" bench.interleave=once bench.single_micro_batch=true
      bench.steps=${STEPS:-6} bench.warmup=${WARMUP:-2} parallel.timeout_s=60)
[ -n "${PROFILE:-}" ] && ARGS+=(bench.profile=true)  # one profiled untimed step per side: where each side's time goes
if [ -n "${DRY:-}" ]; then
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>/dev/null | tail -1
echo "$(ts) == 8B proxy, GBS 8 and one micro-batch: forged, candidate engine.fp8=tensorwise, $AGAINST ($(left) s left)"
timeout $(( $(left) - 15 )) python3 -m forgetrain.bench "${ARGS[@]}" bench.out_dir=/tmp/peers 2>&1 \
  | tee /tmp/peers.log | grep --line-buffered -E "^\[block\]|^error|cannot run|out of memory|^note|^wrote"
cp /tmp/peers.log "$OUT/peers_8b_proxy_gbs8.log"
cp /tmp/peers/bench.json "$OUT/peers_8b_proxy_gbs8_bench.json" 2>/dev/null
if [ -n "${PROFILE:-}" ]; then  # the Chrome traces, in one archive (the per-category table is in bench.json)
  (cd /tmp/peers && ls profile_* >/dev/null 2>&1 && tar czf "$OUT/peers_8b_proxy_gbs8_profiles.tgz" profile_*)
fi
python3 - <<'PY'
import json, os

path = "/tmp/peers/bench.json"
if not os.path.exists(path):
    raise SystemExit("no bench.json: the bench stopped before its first side's block ended (see the log)")
r = json.load(open(path))
print(f"\n{'complete' if r['complete'] else 'INCOMPLETE (cut short)'}; {r['mode']}; MFU vs the bf16 dense peak")
for key, oom in (("rows", "oom"), ("rows_single_micro_batch", "oom_single_micro_batch")):
    rows = r.get(key) or []
    if rows:
        print(f"GBS {rows[0]['global_batch_size']} (grad-accum {rows[0]['grad_accum']})")
        print(f"  {'side':<31} {'step_s':>7} {'tokens/s':>8} {'MFU% PaLM':>9} {'MFU% causal':>11} {'GiB':>6} "
              f"{'forged x':>8}")
    for x in rows:
        side = "candidate (bench.candidate)" if x["side"] == "candidate" else x["side"]
        mem = f"{x['mem_gib']:.1f}" if x["mem_gib"] is not None else "-"
        print(f"  {side:<31} {x['step_s']:>7.4f} {x['tokens_per_s']:>8,.0f} {x['mfu_pct']:>9.2f} "
              f"{x['mfu_causal_pct']:>11.2f} {mem:>6} {x['forged_speedup']:>8.3f}")
    for side in r.get(oom) or []:
        print(f"  {side:<31} out of memory")
for side, why in (r.get("unavailable") or {}).items():
    print(f"  {side}: {why}")
PY
echo "$(ts) done"
