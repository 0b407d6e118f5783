"""Causal SDPA forward + backward at one attention shape, timed per input layout and backend (the performance
issue's attention-backward lever: "a knob, a layout, or a kernel"). Run on the GPU:

    python3 experiments/attention/layouts_h200.py [--seq 8192] [--heads 32] [--kv-heads 8] [--head-dim 128] [--batch 1]

Prints one row per variant and writes attn_layouts.json to $OUT (or the working directory). TFLOP/s count the causal
forward as 2 * b * h * s^2 * d (half of the 4 * b * h * s^2 * d of full attention) and the backward as 2.5x the
forward, as FlashAttention's benchmarks do. Variants:

* ``engine``: the forged fast engine's tensors (scenarios/llama1b_h200/fast.py): q copied out of the fused QKV
  output as [b, s, h, d], k and v strided views of it, GQA through ``enable_gqa``, passed transposed (BSHD memory);
* ``bshd_contig``: q, k and v each contiguous [b, s, h, d], passed transposed;
* ``bhsd_contig``: q, k and v each contiguous [b, h, s, d];
* ``gqa_expanded``: k and v repeated to all query heads (no ``enable_gqa``);
each under cuDNN and under flash attention (torch's FlashAttention-2), where the backend accepts it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _inputs(variant: str, b: int, s: int, nq: int, nkv: int, d: int, dev) -> tuple:
    qpg = nq // nkv
    g = torch.Generator(device=dev).manual_seed(0)
    mixed = torch.randn(b, s, nkv, qpg + 2, d, device=dev, dtype=torch.bfloat16, generator=g)
    if variant == "engine":
        q = mixed[:, :, :, :qpg].reshape(b, s, nq, d)
        k, v = mixed[:, :, :, qpg], mixed[:, :, :, qpg + 1]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qpg > 1
    q = mixed[:, :, :, :qpg].reshape(b, s, nq, d).contiguous()
    k, v = mixed[:, :, :, qpg].contiguous(), mixed[:, :, :, qpg + 1].contiguous()
    if variant == "bshd_contig":
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qpg > 1
    if variant == "bhsd_contig":
        return (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                qpg > 1)
    if variant == "gqa_expanded":
        k, v = k.repeat_interleave(qpg, dim=2), v.repeat_interleave(qpg, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False
    raise ValueError(variant)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(z))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: layouts_h200.py needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    b, s, nq, nkv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    fwd_flop = 2 * b * nq * s * s * d  # causal: half of 4 * b * h * s^2 * d
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for variant in ("engine", "bshd_contig", "bhsd_contig", "gqa_expanded"):
            row = {"backend": backend.name, "variant": variant}
            try:
                q, k, v, gqa = _inputs(variant, b, s, nq, nkv, d, dev)
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                    do = torch.randn_like(o)

                    def fwd():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

                    def bwd():
                        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

                    for _ in range(3):
                        fwd()
                        bwd()
                    tf = statistics.median(_time(fwd, a.reps))
                    tb = statistics.median(_time(bwd, a.reps))
                    # which kernels cuDNN / flash picked (the fused step's profile showed another cuDNN "knob"
                    # for the backward than this isolated call may get)
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fwd()
                        bwd()
                        torch.cuda.synchronize()
                    row["kernels"] = sorted({e.key for e in prof.key_averages() if "sdpa" in e.key.lower()
                                             or "flash" in e.key.lower() or "fmha" in e.key.lower()})
                row.update(fwd_ms=tf, bwd_ms=tb, fwd_tflops=fwd_flop / tf / 1e9, bwd_tflops=2.5 * fwd_flop / tb / 1e9,
                           o_strides=list(o.stride()))
            except Exception as e:  # noqa: BLE001 - a backend that refuses a layout is a result
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            if "error" in row:
                print(f"{row['backend']:<16} {variant:<13} {row['error']}")
            else:
                print(f"{row['backend']:<16} {variant:<13} fwd {row['fwd_ms']:.3f} ms ({row['fwd_tflops']:.0f} TFLOP/s)"
                      f"  bwd {row['bwd_ms']:.3f} ms ({row['bwd_tflops']:.0f} TFLOP/s)")
            torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / "attn_layouts.json"
    out.write_text(json.dumps({"shape": {"batch": b, "seq": s, "heads": nq, "kv_heads": nkv, "head_dim": d},
                               "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                               "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
