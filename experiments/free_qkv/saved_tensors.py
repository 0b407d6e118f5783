"""What one forged decoder layer keeps for its backward, against the memory estimate's activation term.

The measured peaks of ``llama8b_h200``'s offload layouts run about 2.5 GiB above ``forgetrain.memory.estimate``
(115.0 GiB measured for 112.4 estimated at offload fraction 1.0; 129.8 for 127.4 at 0.75): about one bf16
[tokens, hidden] tensor per stored layer. This script finds which. It runs one ``FastBlock`` (compiled as the engine
compiles it, SDPA backend priority included) at the given shape and records every tensor autograd saves through
``forgetrain.memory.saved_storages``, one row per distinct storage (a saved view keeps its whole base alive, so a
storage is counted whole, once); the layer's weights and main grads are left out (the estimate counts them
elsewhere). Sizes are reported in bytes and in "per-token elements" (bytes / (T x
2), T = micro-batch x sequence tokens), against the estimate's per-layer term
(``forgetrain.memory.layer_bytes_per_token``), printed beside the total. The
layer's input x is excluded from the total as the caller owns it (the estimate counts it as the norm's saved input).

Usage (GPU; the defaults are Llama-3-8B's layer at seq 8192, micro-batch 1)::

    python3 experiments/free_qkv/saved_tensors.py [--hidden 4096 --ffn 14336 --heads 32 --groups 8 --head-dim 128
        --seq 8192 --batch 1] [--eager] [--fused] [--free-qkv] [--fp8] [--json PATH]

``--fp8`` runs its four linear layers in FP8 (``engine.fp8=tensorwise``). On a GPU the allocator's count (what the
forward leaves allocated, less its output, plus x) is printed beside the hooks' total: it also sees what a compiled
graph saves out of the hooks' sight. ``--fused`` runs the layer with gradient-accumulation fusion
(``engine.grad_accum_fusion``: the weight gradients go to fp32 main_grad buffers, the linear layers are custom
autograd functions). On CPU it runs too (tiny shapes; CPU inductor saves differently from CUDA's, so only the GPU's
numbers calibrate the estimate).
Errors: exits with ``error:`` on a shape whose heads do not divide (``--heads`` by ``--groups``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--fused", action="store_true", help="gradient-accumulation fusion into fp32 main_grad")
    ap.add_argument("--free-qkv", action="store_true", help="engine.free_qkv: V copied out of the QKV output")
    ap.add_argument("--fp8", action="store_true", help="engine.fp8=tensorwise: the four linear layers in FP8")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.heads % a.groups:
        print(f"error: --heads {a.heads} is not a multiple of --groups {a.groups}", file=sys.stderr)
        return 2

    from scenarios.llama1b_h200 import wgrad
    from scenarios.llama1b_h200.fast import FastBlock, rope_cos_sin, sdpa_priority

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    cfg = SimpleNamespace(num_attention_heads=a.heads, num_query_groups=a.groups, head_dim=a.head_dim,
                          hidden_size=a.hidden, ffn_hidden_size=a.ffn, norm_epsilon=1e-5)
    kern = SimpleNamespace(rmsnorm="torch", swiglu="torch", rope="torch")
    blk = FastBlock(cfg, kern, free_qkv=a.free_qkv, fp8_recipe="tensorwise" if a.fp8 else "none").to(device=dev,
                                                                                                   dtype=dt)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
    acc = None
    if a.fused:
        blk.main_grad = {n: torch.zeros(p.shape, dtype=torch.float32, device=dev)
                         for n, p in blk.named_parameters() if p.dim() == 2}
        acc = wgrad.WGradAccum(first=True, scale=1.0, path=wgrad.probe_path(dev)[0])
    T, h = a.batch * a.seq, a.hidden
    x = torch.randn(a.batch, a.seq, h, dtype=dt, device=dev, requires_grad=True)
    cos, sin = rope_cos_sin(a.seq, a.head_dim, 500000.0, dev, dt)
    run = blk if a.eager else torch.compile(blk)

    from forgetrain.memory import saved_storages

    # the layer's weights and main grads are counted by other parts of the estimate; x is the caller's (the estimate
    # counts it as the input norm's saved input: added back below)
    exclude = [*blk.parameters(), *blk.main_grad.values(), x]
    # the allocator's count beside the hooks': what the forward leaves allocated, less its output, is everything the
    # layer holds for its backward, including what a compiled graph saves out of the hooks' sight (the e4m3 tensors
    # of a compiled FP8 block are not seen by saved_tensors_hooks on torch 2.13, CPU)
    held = None
    with sdpa_priority("cudnn", dev):
        for _ in range(1 if a.eager else 2):  # the first compiled call traces; record the second
            if dev.type == "cuda":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            y, rows = saved_storages(run, x, cos, sin, None, acc, exclude=exclude)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes() + T * a.hidden * 2
            y.float().sum().backward()
    for r in rows:
        r["per_token_elems"] = r["bytes"] / (T * 2)
        r["shapes"] = [str(list(s)) for s in r["shapes"]]
    saved = sum(r["bytes"] for r in rows) + T * h * 2  # x as the estimate counts it
    from forgetrain.memory import layer_bytes_per_token

    est = T * layer_bytes_per_token(cfg, 2, fast=True, free_qkv=a.free_qkv)
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "compiled": not a.eager, "fused": a.fused, "free_qkv": a.free_qkv, "fp8": a.fp8, "tokens": T,
           "saved_bytes": saved, "allocator_held_bytes": held,
           "estimate_bytes": est, "saved_over_estimate": saved / est,
           "gap_gib_per_layer": (saved - est) / 2**30, "rows": rows}
    print(f"{out['device']}, torch {torch.__version__}, {'eager' if a.eager else 'compiled'}"
          f"{', fused' if a.fused else ''}{', free_qkv' if a.free_qkv else ''}{', fp8' if a.fp8 else ''}: saved "
          f"{saved / 2**30:.3f} GiB per layer"
          f"{f' (allocator: {held / 2**30:.3f} GiB)' if held is not None else ''}, estimate "
          f"{est / 2**30:.3f} GiB ({saved / est:.3f}x; gap {out['gap_gib_per_layer']:+.3f} GiB per layer)")
    for r in rows:
        print(f"  {r['bytes'] / 2**20:10.1f} MiB  {r['per_token_elems']:8.1f} /token  {r['dtype']:15s} "
              f"{', '.join(r['shapes'])[:90]}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
