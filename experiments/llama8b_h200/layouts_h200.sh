#!/usr/bin/env bash
# Device call 16 (one H200): the llama8b_h200 scenario (issue 18), full-depth Llama-3-8B on one GPU. Its default
# offloads AdamW moments to host memory (engine.optimizer_offload_fraction 1.0 from 2026-12-02's second session,
# 0.65 with engine.free_qkv since 2026-12-03's seventh), stores every activation and keeps resident bf16 weights,
# with gradient accumulation fusion, at global batch 32; DEV is its device-only layout (no offload,
# engine.recompute=full, engine.bf16_weights=per_layer), the default before that. One part per call:
#   PART=a  equivalence at a depth Megatron-core fits (8B width, 2 layers, seq 2048, micro-batch 1 x grad-accum 2):
#           exact mode with the device-only layout (DEV) at the bitwise tier (deterministic), then the fast default
#           (the offload layout since the second session) at the tolerance tier (stricter than every fast
#           optimisation's declared tier). Measured 2026-12-02:
#           5.2-5.7 min per bitwise check before the threaded digests, 2.9 min after (the offload check of
#           PART=f); a3 alone 232 s. Two checks fit one call now: A="a1 a2", then A=a3.
#   PART=b  the real run: full depth (32 layers, seq 8192), 120 steps of the scenario default on the embedded
#           Shakespeare text at global batch 1 (DEV_RUN=1: the device-only layout), no checkpoint (the fp32
#           state is 96 GB on a 64 GB disk); the loss must fall; peak memory is in every trace record (mem_gib).
#           No final-weights export either (32 GB: forgetrain.disk refuses it on the device's disk). Measured
#           2026-12-02 with the device-only layout: 241 s; loss 12.51 -> 5.85, peak 126.8 GiB, 1.03 s per step.
#           The default's step at one micro-batch is about 2.2 s (the offload's fixed cost): about 5 min.
#   PART=c  python -m forgetrain.bench scenario=llama8b_h200 at its global batch 32 (grad-accum 32) and one
#           micro-batch, warm-up 1, median of 3 (each offload step is about 25 s; about 6 min),
#           A-B-A beside torchtitan (FSDP2 on one rank, its own full activation checkpointing under
#           engine.recompute=full); needs .whl_sides (SIDES=1 bash scripts/device/wheels.sh). torchtitan 0.3.0
#           cannot run on the device's torch 2.11 (2026-12-02): the bench prints why in one line.
#   PART=d  the same beside torch.compile (fp32 weights under autocast, fused AdamW, every block checkpointed).
#           A side that runs out of memory is reported as such by the bench (the answer "none fits" is a result).
#   PART=cd both sides in one call (the forged side timed once; carry [".whl", ".whl_sides"]).
#           The sides run with every block checkpointed (bench.side_recompute=full: how their users fit the card),
#           the forged side with its own layout. Before 2026-12-03 (fourth session) PART=c/d/cd did not set it, so
#           under the offload default (recompute none) the sides stored their activations.
#           EXTRA adds overrides: EXTRA=bench.single_micro_batch=false times the GBS-32 headline alone (PART=cd with
#           both batches ran past the call's 600 s on 2026-12-03, fifth session, with nothing returned).
#   PART=e  the recompute knob of the device-only layout: the forged engine alone at global batch 8,
#           engine.recompute_num_layers 32, 30, 28
#           (the estimate's 128.2, 131.0, 133.8 GiB), step_s, both MFUs and peak mem_gib for each. About 8 min.
#   PART=f  the optimizer offload (AdamW moments in pinned host memory, streamed through the GPU): the forged
#           engine alone at global batch 8 with no recompute and resident bf16 weights, at
#           engine.optimizer_offload_fraction FR (default 1.0: estimate 112.4 GiB; FR=0.65: 133.3 GiB, a second
#           call); then, unless NOVERIFY=1, exact mode with offload 1.0 at the bitwise tier vs Megatron-core at 2
#           layers. Measured 2026-12-02: 420 s (the bench 240 s, the bitwise check 174 s).
#           History (issue 18): F 1.0 61.5-62.8% at GBS 32 over six runs; F 0.75 63.08% (sixth session). Seventh
#           session (2026-12-03), with engine.free_qkv: F 0.65 64.58% at GBS 32, peak 133.5 GiB; one machine at GBS
#           8, FR="1.0 0.65 1.0": 0.65 6.4% faster; PART=v VFR=0.65 bitwise. The scenario default is F 0.65 with
#           engine.free_qkv since then. Eighth session (2026-12-03), at that default: PART=a A=a3 tolerance pass (about
#           225 s), PART=b 120 steps, loss 12.51 -> 5.85, peak 133.4 GiB (268 s).
#   PART=e and PART=f take GBS (default 8): at GBS 8 the offload's fixed cost per step (about 1.8 s of 7.3 s at F
#           1.0, 2026-12-02) is a quarter of the step; GBS=32 NOVERIFY=1 PART=f shows it at a larger global batch.
#   PART=a also runs exact mode with engine.recompute_num_layers=1 at the bitwise tier (layer 0 recomputed,
#   layer 1 stored).
#   run: PART=a bash scripts/device/call16_llama8b_h200.sh   (carry [".whl"]; PART=c carries [".whl", ".whl_sides"])
set -u
. scripts/device/setup.sh
S="scenario=llama8b_h200 hardware=h200 parallel.timeout_s=60"
DEV="engine.optimizer_offload_fraction=0 engine.recompute=full engine.bf16_weights=per_layer"
SMALL="model.num_layers=2 model.seq_length=2048 train.micro_batch_size=1 train.global_batch_size=2 \
train.lr_warmup_steps=2"
GBS=${GBS:-8}   # PART=e and f: the global batch (micro-batch 1, so grad-accum GBS); the file names carry it unless 8
G=$([ "$GBS" = 8 ] || echo "_gbs$GBS")
verify_offload() {
  VFR=${VFR:-1.0}  # the offload fraction the bitwise check runs (the file name carries it unless 1.0)
  echo "$(ts) == exact mode, optimizer offload $VFR: bitwise vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL mode=exact \
    train.deterministic=true tier=bitwise \
    engine.optimizer_offload_fraction=$VFR verify.steps=6 verify.out_dir=/tmp/v16f 2>&1 | filt 6
  cp /tmp/v16f/verdict.json $OUT/call16_exact_offload$([ "$VFR" = 1.0 ] || echo "_$VFR")_bitwise_verdict.json 2>/dev/null
}
case "${PART:-a}" in
a)
  # A picks the checks (default all three; about 5-6 min each on the H200, so one per call for now)
  A=${A:-"a1 a2 a3"}
  if [[ $A == *a1* ]]; then
  echo "$(ts) == exact mode, per-layer bf16 weights + recompute: bitwise vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL $DEV mode=exact \
    train.deterministic=true tier=bitwise \
    verify.steps=6 verify.out_dir=/tmp/v16a 2>&1 | filt 6
  cp /tmp/v16a/verdict.json $OUT/call16_exact_bitwise_verdict.json 2>/dev/null
  fi
  if [[ $A == *a2* ]]; then
  echo "$(ts) == exact mode, block recompute (first layer only): bitwise vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL $DEV mode=exact \
    train.deterministic=true tier=bitwise \
    engine.recompute_num_layers=1 verify.steps=6 verify.out_dir=/tmp/v16b 2>&1 | filt 6
  cp /tmp/v16b/verdict.json $OUT/call16_exact_block_bitwise_verdict.json 2>/dev/null
  fi
  if [[ $A == *a3* ]]; then
  echo "$(ts) == fast default (scenario switches): tolerance vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL train.deterministic=true tier=tolerance verify.steps=8 \
    verify.out_dir=/tmp/v16t 2>&1 | filt 6
  cp /tmp/v16t/verdict.json $OUT/call16_fast_tolerance_verdict.json 2>/dev/null
  fi
  ;;
b)
  echo "$(ts) == full depth, 120 steps ${DEV_RUN:+(device-only layout) }($(left) s left)"
  timeout $(left) python3 -m forgetrain $S ${DEV_RUN:+$DEV} train.steps=120 train.global_batch_size=1 train.lr_warmup_steps=10 \
    train.save=false train.final_params=false train.log_interval=10 train.out_dir=/tmp/r16 2>&1 | filt 8
  cp /tmp/r16/trace/trace.jsonl $OUT/call16_full_depth_trace.jsonl 2>/dev/null
  python3 - <<'PY'
import json
recs = [json.loads(l) for l in open("/tmp/r16/trace/trace.jsonl")]
if recs:
    first, last = recs[0], recs[-1]
    tail = sorted(r["step_s"] for r in recs[-20:])
    print(f"steps {len(recs)}  loss {first['loss']:.3f} -> {last['loss']:.3f}  peak mem_gib "
          f"{max(r.get('mem_gib', 0) for r in recs):.1f}  median step_s (last 20) {tail[len(tail)//2]:.3f}  "
          f"mfu_pct {last['mfu_pct']:.1f}  mfu_causal_pct {last['mfu_causal_pct']:.1f}")
PY
  ;;
c|d|cd)
  case $PART in c) side=torchtitan ;; d) side=torch_compile ;; cd) side=torch_compile,torchtitan ;; esac
  echo "$(ts) == bench: forged (scenario default) vs $side, GBS 32 + one micro-batch ($(left) s left)"
  timeout $(left) python3 -m forgetrain.bench $S "bench.against=[$side]" bench.side_recompute=full bench.steps=3 \
    bench.warmup=1 bench.interleave=never train.deterministic=false bench.out_dir=/tmp/b16 ${EXTRA:-} 2>&1 | tee $OUT/call16_bench.log | filt 30
  cp /tmp/b16/bench.json $OUT/call16_bench_llama8b_h200_gbs32_${side//,/_}.json 2>/dev/null
  ;;
e)
  for n in 32 30 28; do
    echo "$(ts) == bench: forged alone, engine.recompute_num_layers=$n, GBS $GBS ($(left) s left)"
    timeout $(left) python3 -m forgetrain.bench $S "bench.against=[]" bench.steps=3 bench.warmup=1 \
      $DEV engine.recompute_num_layers=$n train.global_batch_size=$GBS train.deterministic=false \
      bench.out_dir=/tmp/b16e$n 2>&1 | filt 12
    cp /tmp/b16e$n/bench.json $OUT/call16_bench_recompute_layers_$n$G.json 2>/dev/null
  done
  ;;
f)
  # FR may repeat a value (an A-B-A on one machine: FR="1.0 0.75 1.0"); then the files carry the run's index
  i=0; n=$(echo ${FR:-1.0} | wc -w)
  for fr in ${FR:-1.0}; do
    i=$((i+1)); ix=$([ "$n" = 1 ] || echo "_$i")
    echo "$(ts) == $i. bench: forged alone, engine.optimizer_offload_fraction=$fr, no recompute, GBS $GBS ($(left) s left)"
    timeout $(left) python3 -m forgetrain.bench $S "bench.against=[]" bench.steps=3 bench.warmup=1 \
      engine.recompute=none engine.bf16_weights=resident engine.optimizer_offload_fraction=$fr \
      train.global_batch_size=$GBS train.deterministic=false bench.out_dir=/tmp/b16f$i ${EXTRA:-} 2>&1 | filt 12
    cp /tmp/b16f$i/bench.json $OUT/call16_bench_offload_${fr}$G$ix.json 2>/dev/null
  done
  [ -n "${NOVERIFY:-}" ] && { echo "$(ts) done"; exit 0; }
  verify_offload
  ;;
v)
  verify_offload
  ;;
esac
echo "$(ts) done"
