#!/usr/bin/env bash
# Validate every forged kernel at the full scenario shapes on one H200 (fwd + bwd vs the fp64 oracle, beside the op
# it replaces), benchmark the passing ones against the replaced op and torch.compile of it, and seal them.
#
# Run on the lent GPU machine from the repo root (no wheels needed: forgetrain.kernels uses only torch, triton,
# numpy and pyyaml, all present there):
#     bash experiments/kernels/seal_h200.sh            (KERNELS="adamw ce_chunk" picks kernels)
# Results under $OUT (4 files, within the device tool's limits):
#     kernels.json   {kernel: {"validation": report, "bench": timings}} merged over kernels
#     registry.json  forgetrain/kernels/registry.json with the new cuda seals (copy it back into the repo)
#     kernels.log    everything printed; env.txt the versions and the GPU
# Each kernel runs in its own process under its own time limit (below; about 8 minutes in all, so the call fits
# the device tool's 10-minute limit), so one slow torch.compile cannot take the others' numbers with it; partial
# JSON is written after every benchmark case.
#   run(command="bash experiments/kernels/seal_h200.sh", timeout_s=600)
set -uo pipefail
OUT=${OUT:-/tmp/kernels_bench_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
# default: every kernel of the switch table (forgetrain/kernels/switches.py), never a list kept by hand
KERNELS=${KERNELS:-$($PY -c "from forgetrain.kernels import KERNELS; print(' '.join(KERNELS))")}
limit() {  # seconds per kernel: validation (all full shapes) + bench (fwd, fwd+bwd; 3 variants) + seal
  case "$1" in
    cross_entropy) echo "${KERNEL_TIMEOUT_S:-150}" ;;
    rmsnorm|rope) echo "${KERNEL_TIMEOUT_S:-95}" ;;
    *) echo "${KERNEL_TIMEOUT_S:-80}" ;;
  esac
}
LOG="$OUT/kernels.log"

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || true
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee "$LOG"

cp forgetrain/kernels/registry.json "$OUT/registry.json" 2>/dev/null || echo '{"format": 1, "kernels": {}}' > "$OUT/registry.json"

for k in $KERNELS; do
  echo "=== $k ===" | tee -a "$LOG"
  T=$(limit "$k")
  timeout -k 10 "$T" $PY -m forgetrain.kernels seal --kernel "$k" --device cuda --shapes full \
      --repeats 20 --warmup 5 --registry "$OUT/registry.json" --json "$WORK/$k.json" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$k: TIMED OUT after ${T}s (partial results kept)" | tee -a "$LOG"
  echo "$k: exit $rc" | tee -a "$LOG"
done

$PY - "$WORK" "$OUT/kernels.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
from forgetrain.trace import atomic_write_json
work, out = Path(sys.argv[1]), sys.argv[2]
merged = {}
for f in sorted(work.glob("*.json")):
    try:
        merged.update(json.loads(f.read_text()))
    except Exception as e:
        merged[f.stem] = {"error": f"unreadable partial results: {e}"}
atomic_write_json(out, merged)
print("kernel          valid  fwd x(ref) x(compile)  fwd+bwd x(ref) x(compile)")
for name, r in merged.items():
    v = r.get("validation", {})
    row = f"{name:<15} {'PASS' if v.get('passed') else 'FAIL':<6}"
    for case in (r.get("bench") or {}).get("cases", [])[-1:]:
        for ph in ("fwd", "fwd_bwd"):
            sp = case.get("speedup", {}).get(ph, {})
            row += f" {sp.get('vs_reference', float('nan')):>6.2f} {sp.get('vs_compiled', float('nan')):>6.2f}   "
    print(row)
PY
rm -rf "$WORK"
