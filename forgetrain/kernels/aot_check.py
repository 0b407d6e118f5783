"""Compile every Triton kernel ahead of time for a GPU architecture, on a machine without a GPU.

The CPU interpreter executes kernels as numpy code, so it cannot catch what only the GPU compiler rejects
(loop-carried type changes, pointer casts, hints, register-hungry block sizes). ``triton.compile`` with an
explicit ``GPUTarget`` runs the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through the bundled
ptxas) without a device. :func:`compile_all` does that for the production kernels with the signatures and
meta-parameters their launchers use at the scenario shapes (bf16; sm_90 = H100/H200 by default).

Must run with ``TRITON_INTERPRET=0`` (in its own process: under the interpreter ``@triton.jit`` returns
interpreter objects that cannot be compiled). ``python -m forgetrain.kernels.aot_check [arch]`` prints a table and
exits 1 when any kernel fails to compile.
"""

from __future__ import annotations

import os
import sys
import time


def _cases():
    from forgetrain.kernels import module_of
    from forgetrain.kernels._triton import tl

    rmsnorm, swiglu, rope, cross_entropy, ce_chunk, adamw = (
        module_of(n) for n in ("rmsnorm", "swiglu", "rope", "cross_entropy", "ce_chunk", "adamw"))

    p16, p32, p64, i32, f32 = "*bf16", "*fp32", "*i64", "i32", "fp32"
    rms_f = dict(X=p16, R=p16, W=p16, Y=p16, S=p16, RSTD=p32, stride_x=i32, stride_r=i32, stride_y=i32,
                 stride_s=i32, H=i32, eps=f32, HAS_RES="constexpr", BLOCK_H="constexpr")
    rms_b = dict(DY=p16, DSO=p16, S=p16, W=p16, RSTD=p32, DX=p16, DR=p16, DWP=p32, stride_dy=i32, stride_dso=i32,
                 stride_s=i32, stride_dx=i32, stride_dr=i32, M=i32, H=i32, rows_per_prog=i32,
                 HAS_DSO="constexpr", HAS_DR="constexpr", BLOCK_H="constexpr")
    sw_f = dict(G=p16, U=p16, Y=p16, stride_g=i32, stride_u=i32, stride_y=i32, n_cols=i32, BLOCK="constexpr")
    sw_b = dict(DY=p16, G=p16, U=p16, DG=p16, DU=p16, stride_dy=i32, stride_g=i32, stride_u=i32, stride_dg=i32,
                stride_du=i32, n_cols=i32, BLOCK="constexpr")
    sw_pb = dict(DY=p16, X=p16, DX=p16, stride_dy=i32, stride_x=i32, stride_dx=i32, n_cols=i32, BLOCK="constexpr")
    rp = dict(T=p16, COS=p32, SIN=p32, OUT=p16, stride_tb=i32, stride_ts=i32, stride_th=i32, stride_ob=i32,
              stride_os=i32, stride_oh=i32, stride_cs=i32, S=i32, NH=i32, HALF="constexpr", BLOCK_H="constexpr",
              BLOCK_D="constexpr", BACKWARD="constexpr")
    ce_f = dict(LOGITS=p32, LABELS=p64, M=p32, S=p32, ZL=p32, stride_l=i32, v_start=i32, VC=i32,
                ignore_index=i32, FIRST="constexpr", BLOCK_V="constexpr")
    ce_b = dict(LOGITS=p32, LSE=p32, LABELS=p64, DLOSS=p32, DZ=p16, stride_l=i32, stride_dz=i32, stride_dloss=i32,
                v_start=i32, VC=i32, ignore_index=i32, BLOCK="constexpr")
    cc = dict(Z=p16, LABELS=p64, LOSS=p32, DZ=p16, stride_z=i32, stride_dz=i32, V=i32, inv_n=f32, BLOCK="constexpr")
    ad = dict(TABLE=p64, BLOCKS=p64, decay=f32, w1=f32, b2=f32, omb2=f32, step_size_neg=f32, bc2_sqrt=f32, eps=f32,
              P_DT="constexpr", G_DT="constexpr", HAS_MAIN="constexpr", LERP_SMALL="constexpr",
              ALIGN_HINT="constexpr", BLOCK="constexpr")
    ad_c = dict(P_DT=tl.bfloat16, G_DT=tl.float32, HAS_MAIN=True, LERP_SMALL=True, BLOCK=2048)
    return [
        ("rmsnorm.fwd H=4096", rmsnorm._rmsnorm_fwd_kernel, rms_f, dict(HAS_RES=True, BLOCK_H=4096), 16),
        ("rmsnorm.fwd H=2048 no-res", rmsnorm._rmsnorm_fwd_kernel, rms_f, dict(HAS_RES=False, BLOCK_H=2048), 8),
        ("rmsnorm.bwd H=4096", rmsnorm._rmsnorm_bwd_kernel, rms_b, dict(HAS_DSO=True, HAS_DR=True, BLOCK_H=4096), 16),
        ("swiglu.fwd", swiglu._swiglu_fwd_kernel, sw_f, dict(BLOCK=1024), 4),
        ("swiglu.bwd", swiglu._swiglu_bwd_kernel, sw_b, dict(BLOCK=1024), 4),
        ("swiglu.bwd packed", swiglu._swiglu_packed_bwd_kernel, sw_pb, dict(BLOCK=1024), 4),
        ("rope.fwd H=32 D=128", rope._rope_kernel, rp, dict(HALF=64, BLOCK_H=32, BLOCK_D=64, BACKWARD=False), 4),
        ("rope.bwd H=8 D=128", rope._rope_kernel, rp, dict(HALF=64, BLOCK_H=8, BLOCK_D=64, BACKWARD=True), 4),
        ("cross_entropy.fwd first", cross_entropy._ce_fwd_kernel, ce_f, dict(FIRST=True, BLOCK_V=4096), 8),
        ("cross_entropy.fwd", cross_entropy._ce_fwd_kernel, ce_f, dict(FIRST=False, BLOCK_V=4096), 8),
        ("cross_entropy.bwd", cross_entropy._ce_bwd_kernel, ce_b, dict(BLOCK=2048), 8),
        ("ce_chunk V=128256 bf16", ce_chunk._ce_chunk_kernel, cc, dict(BLOCK=ce_chunk.MAX_BLOCK),
         ce_chunk._num_warps(ce_chunk.MAX_BLOCK)),
        ("ce_chunk fp32", ce_chunk._ce_chunk_kernel, {**cc, "Z": p32, "DZ": p32}, dict(BLOCK=ce_chunk.MAX_BLOCK),
         ce_chunk._num_warps(ce_chunk.MAX_BLOCK)),
        ("adamw hint", adamw._adamw_kernel, ad, {**ad_c, "ALIGN_HINT": True}, 8),
        ("adamw no-hint bf16 grads", adamw._adamw_kernel, ad,
         {**ad_c, "ALIGN_HINT": False, "G_DT": tl.bfloat16, "LERP_SMALL": False}, 8),
    ]


def compile_all(arch: int = 90, warp_size: int = 32) -> list[dict]:
    """Compile each production kernel for ``cuda:sm_<arch>``; one ``{"name", "ok", "s", "error"}`` per kernel.

    Raises RuntimeError when called under the interpreter.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False"):
        raise RuntimeError("aot_check needs TRITON_INTERPRET=0 (run it in its own process)")
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, warp_size)
    out = []
    for name, fn, sig, consts, warps in _cases():
        t0 = time.perf_counter()
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            k = triton.compile(src, target=target, options={"num_warps": warps})
            ok, err = bool(k.asm.get("cubin")), None
        except Exception as e:  # noqa: BLE001 - reported per kernel
            ok, err = False, f"{type(e).__name__}: {e}"[:2000]
        out.append({"name": name, "ok": ok, "s": round(time.perf_counter() - t0, 2), "error": err})
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ["TRITON_INTERPRET"] = "0"
    res = compile_all(int(argv[0]) if argv else 90)
    for r in res:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['name']:<28} {r['s']:>6.2f}s  {r['error'] or ''}")
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
