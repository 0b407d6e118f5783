#!/usr/bin/env bash
# The llama8b_h200 scenario on one H200: full-depth Llama-3-8B on one GPU. Its default offloads the AdamW moments
# of 65% of the parameters to host memory (engine.optimizer_offload_fraction=0.65), copies V out of the fused QKV
# output (engine.free_qkv), stores every activation and keeps resident bf16 weights, with gradient accumulation
# fusion, at global batch 32; DEV is its device-only layout (no offload, engine.recompute=full,
# engine.bf16_weights=per_layer). One part per call:
#   PART=a  equivalence at a depth Megatron-core fits (8B width, 2 layers, seq 2048, micro-batch 1 x grad-accum 2):
#           A picks the checks (default "a1 a2 a3"; about 3-6 min each, so one or two per call):
#           a1 exact mode with the device-only layout (DEV) at the bitwise tier (deterministic); a2 the same with
#           engine.recompute_num_layers=1 (layer 0 recomputed, layer 1 stored); a3 the fast default at the
#           tolerance tier (stricter than every fast optimisation's declared tier; about 4 min).
#   PART=b  the real run: full depth (32 layers, seq 8192), 120 steps of the scenario default on the embedded
#           Shakespeare text at global batch 1 (DEV_RUN=1: the device-only layout), no checkpoint (the fp32
#           state is 96 GB on a 64 GB disk); the loss must fall; peak memory is in every trace record (mem_gib).
#           No final-weights export either (32 GB: forgetrain.disk refuses it on the device's disk). About 5 min.
#   PART=c  python -m forgetrain.bench scenario=llama8b_h200 at its global batch 32 (grad-accum 32) and one
#           micro-batch, warm-up 1, median of 3 (each step is about 24 s; about 6 min), A-B-A beside torchtitan;
#           needs .whl_sides (SIDES=1 bash scripts/device/wheels.sh).
#   PART=d  the same beside torch.compile.   PART=cd both sides in one call (carry [".whl", ".whl_sides"]).
#           The sides run with every block checkpointed (bench.side_recompute=full: how their users fit the card),
#           the forged side with its own layout. A side that runs out of memory is reported as such by the bench
#           (the answer "none fits" is a result). EXTRA adds overrides: EXTRA=bench.single_micro_batch=false times
#           the GBS-32 headline alone (both batches of PART=cd do not fit one call's 600 s).
#   PART=e  the recompute knob of the device-only layout: the forged engine alone at global batch GBS,
#           engine.recompute_num_layers 32, 30, 28 (the estimate's 128.2, 131.0, 133.8 GiB). About 8 min.
#   PART=f  the optimizer offload (AdamW moments in pinned host memory, streamed through the GPU): the forged
#           engine alone at global batch GBS with no recompute and resident bf16 weights, at
#           engine.optimizer_offload_fraction FR (default 1.0; FR may repeat values for an A-B-A on one machine:
#           FR="1.0 0.65 1.0"); then, unless NOVERIFY=1, exact mode with offload VFR at the bitwise tier vs
#           Megatron-core at 2 layers (about 3 min).   PART=v the bitwise check alone (VFR, default 1.0).
#   PART=e and PART=f take GBS (default 8): at GBS 8 the offload's fixed cost per step is a quarter of the step;
#           GBS=32 NOVERIFY=1 PART=f shows it at the scenario's global batch.
#   run: PART=a bash experiments/llama8b_h200/layouts_h200.sh   (carry [".whl"]; PART=c carries [".whl", ".whl_sides"])
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
  cp /tmp/v16f/verdict.json $OUT/llama8b_h200_exact_offload$([ "$VFR" = 1.0 ] || echo "_$VFR")_bitwise_verdict.json 2>/dev/null
}
case "${PART:-a}" in
a)
  # A picks the checks (default all three; about 3-6 min each on the H200, so one or two per call)
  A=${A:-"a1 a2 a3"}
  if [[ $A == *a1* ]]; then
  echo "$(ts) == exact mode, per-layer bf16 weights + recompute: bitwise vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL $DEV mode=exact \
    train.deterministic=true tier=bitwise \
    verify.steps=6 verify.out_dir=/tmp/v16a 2>&1 | filt 6
  cp /tmp/v16a/verdict.json $OUT/llama8b_h200_exact_bitwise_verdict.json 2>/dev/null
  fi
  if [[ $A == *a2* ]]; then
  echo "$(ts) == exact mode, block recompute (first layer only): bitwise vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL $DEV mode=exact \
    train.deterministic=true tier=bitwise \
    engine.recompute_num_layers=1 verify.steps=6 verify.out_dir=/tmp/v16b 2>&1 | filt 6
  cp /tmp/v16b/verdict.json $OUT/llama8b_h200_exact_block_bitwise_verdict.json 2>/dev/null
  fi
  if [[ $A == *a3* ]]; then
  echo "$(ts) == fast default (scenario switches): tolerance vs Megatron-core ($(left) s left)"
  timeout $(left) python3 -m forgetrain.verify $S $SMALL train.deterministic=true tier=tolerance verify.steps=8 \
    verify.out_dir=/tmp/v16t 2>&1 | filt 6
  cp /tmp/v16t/verdict.json $OUT/llama8b_h200_fast_tolerance_verdict.json 2>/dev/null
  fi
  ;;
b)
  echo "$(ts) == full depth, 120 steps ${DEV_RUN:+(device-only layout) }($(left) s left)"
  timeout $(left) python3 -m forgetrain $S ${DEV_RUN:+$DEV} train.steps=120 train.global_batch_size=1 train.lr_warmup_steps=10 \
    train.save=false train.final_params=false train.log_interval=10 train.out_dir=/tmp/r16 2>&1 | filt 8
  cp /tmp/r16/trace/trace.jsonl $OUT/llama8b_h200_full_depth_trace.jsonl 2>/dev/null
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
    bench.warmup=1 bench.interleave=never train.deterministic=false bench.out_dir=/tmp/b16 ${EXTRA:-} 2>&1 | tee $OUT/llama8b_h200_bench.log | filt 30
  cp /tmp/b16/bench.json $OUT/llama8b_h200_bench_llama8b_h200_gbs32_${side//,/_}.json 2>/dev/null
  ;;
e)
  for n in 32 30 28; do
    echo "$(ts) == bench: forged alone, engine.recompute_num_layers=$n, GBS $GBS ($(left) s left)"
    timeout $(left) python3 -m forgetrain.bench $S "bench.against=[]" bench.steps=3 bench.warmup=1 \
      $DEV engine.recompute_num_layers=$n train.global_batch_size=$GBS train.deterministic=false \
      bench.out_dir=/tmp/b16e$n 2>&1 | filt 12
    cp /tmp/b16e$n/bench.json $OUT/llama8b_h200_bench_recompute_layers_$n$G.json 2>/dev/null
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
    cp /tmp/b16f$i/bench.json $OUT/llama8b_h200_bench_offload_${fr}$G$ix.json 2>/dev/null
  done
  [ -n "${NOVERIFY:-}" ] && { echo "$(ts) done"; exit 0; }
  verify_offload
  ;;
v)
  verify_offload
  ;;
esac
echo "$(ts) done"
