"""Compile every Triton kernel ahead of time for a GPU architecture, on a machine without a GPU.

The CPU interpreter executes kernels as numpy code, so it cannot catch what only the GPU compiler rejects
(loop-carried type changes, pointer casts, hints, register-hungry block sizes). ``triton.compile`` with an
explicit ``GPUTarget`` runs the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through the bundled
ptxas) without a device. :func:`compile_all` does that for the production kernels with the signatures and
meta-parameters their launchers use at the scenario shapes (bf16; sm_90 = H100/H200 by default), for every kernel
of the switch table (:data:`CASES`).

Must run with ``TRITON_INTERPRET=0`` (in its own process: under the interpreter ``@triton.jit`` returns
interpreter objects that cannot be compiled). ``python -m forgetrain.kernels.aot_check [arch]`` prints a table and
exits 1 when any kernel fails to compile.
"""

from __future__ import annotations

import os
import sys
import time


P16, P32, P64, I32, F32 = "*bf16", "*fp32", "*i64", "i32", "fp32"


def _rmsnorm(m) -> list[tuple]:
    fwd = dict(X=P16, R=P16, W=P16, Y=P16, S=P16, RSTD=P32, stride_x=I32, stride_r=I32, stride_y=I32,
               stride_s=I32, H=I32, eps=F32, HAS_RES="constexpr", BLOCK_H="constexpr")
    bwd = dict(DY=P16, DSO=P16, S=P16, W=P16, RSTD=P32, DX=P16, DR=P16, DWP=P32, stride_dy=I32, stride_dso=I32,
               stride_s=I32, stride_dx=I32, stride_dr=I32, M=I32, H=I32, rows_per_prog=I32,
               HAS_DSO="constexpr", HAS_DR="constexpr", BLOCK_H="constexpr")
    return [("rmsnorm.fwd H=4096", m._rmsnorm_fwd_kernel, fwd, dict(HAS_RES=True, BLOCK_H=4096), 16),
            ("rmsnorm.fwd H=2048 no-res", m._rmsnorm_fwd_kernel, fwd, dict(HAS_RES=False, BLOCK_H=2048), 8),
            ("rmsnorm.bwd H=4096", m._rmsnorm_bwd_kernel, bwd, dict(HAS_DSO=True, HAS_DR=True, BLOCK_H=4096), 16)]


def _swiglu(m) -> list[tuple]:
    fwd = dict(G=P16, U=P16, Y=P16, stride_g=I32, stride_u=I32, stride_y=I32, n_cols=I32, BLOCK="constexpr")
    bwd = dict(DY=P16, G=P16, U=P16, DG=P16, DU=P16, stride_dy=I32, stride_g=I32, stride_u=I32, stride_dg=I32,
               stride_du=I32, n_cols=I32, BLOCK="constexpr")
    packed = dict(DY=P16, X=P16, DX=P16, stride_dy=I32, stride_x=I32, stride_dx=I32, n_cols=I32, BLOCK="constexpr")
    return [("swiglu.fwd", m._swiglu_fwd_kernel, fwd, dict(BLOCK=1024), 4),
            ("swiglu.bwd", m._swiglu_bwd_kernel, bwd, dict(BLOCK=1024), 4),
            ("swiglu.bwd packed", m._swiglu_packed_bwd_kernel, packed, dict(BLOCK=1024), 4)]


def _rope(m) -> list[tuple]:
    sig = dict(T=P16, COS=P32, SIN=P32, OUT=P16, stride_tb=I32, stride_ts=I32, stride_th=I32, stride_ob=I32,
               stride_os=I32, stride_oh=I32, stride_cs=I32, S=I32, NH=I32, HALF="constexpr", BLOCK_H="constexpr",
               BLOCK_D="constexpr", BACKWARD="constexpr")
    return [("rope.fwd H=32 D=128", m._rope_kernel, sig, dict(HALF=64, BLOCK_H=32, BLOCK_D=64, BACKWARD=False), 4),
            ("rope.bwd H=8 D=128", m._rope_kernel, sig, dict(HALF=64, BLOCK_H=8, BLOCK_D=64, BACKWARD=True), 4)]


def _cross_entropy(m) -> list[tuple]:
    fwd = dict(LOGITS=P32, LABELS=P64, M=P32, S=P32, ZL=P32, stride_l=I32, v_start=I32, VC=I32,
               ignore_index=I32, FIRST="constexpr", BLOCK_V="constexpr")
    bwd = dict(LOGITS=P32, LSE=P32, LABELS=P64, DLOSS=P32, DZ=P16, stride_l=I32, stride_dz=I32, stride_dloss=I32,
               v_start=I32, VC=I32, ignore_index=I32, BLOCK="constexpr")
    return [("cross_entropy.fwd first", m._ce_fwd_kernel, fwd, dict(FIRST=True, BLOCK_V=4096), 8),
            ("cross_entropy.fwd", m._ce_fwd_kernel, fwd, dict(FIRST=False, BLOCK_V=4096), 8),
            ("cross_entropy.bwd", m._ce_bwd_kernel, bwd, dict(BLOCK=2048), 8)]


def _ce_chunk(m) -> list[tuple]:
    sig = dict(Z=P16, LABELS=P64, LOSS=P32, DZ=P16, stride_z=I32, stride_dz=I32, V=I32, inv_n=F32, BLOCK="constexpr")
    warps = m._num_warps(m.MAX_BLOCK)
    return [("ce_chunk V=128256 bf16", m._ce_chunk_kernel, sig, dict(BLOCK=m.MAX_BLOCK), warps),
            ("ce_chunk fp32", m._ce_chunk_kernel, {**sig, "Z": P32, "DZ": P32}, dict(BLOCK=m.MAX_BLOCK), warps)]


def _adamw(m) -> list[tuple]:
    from forgetrain.kernels._triton import tl

    sig = dict(TABLE=P64, BLOCKS=P64, decay=F32, w1=F32, b2=F32, omb2=F32, step_size_neg=F32, bc2_sqrt=F32, eps=F32,
               P_DT="constexpr", G_DT="constexpr", HAS_MAIN="constexpr", LERP_SMALL="constexpr",
               ALIGN_HINT="constexpr", BLOCK="constexpr")
    base = dict(P_DT=tl.bfloat16, G_DT=tl.float32, HAS_MAIN=True, LERP_SMALL=True, BLOCK=2048)
    return [("adamw hint", m._adamw_kernel, sig, {**base, "ALIGN_HINT": True}, 8),
            ("adamw no-hint bf16 grads", m._adamw_kernel, sig,
             {**base, "ALIGN_HINT": False, "G_DT": tl.bfloat16, "LERP_SMALL": False}, 8)]


# kernel name (forgetrain/kernels/switches.py) -> its launches at the scenario shapes: (name, kernel, signature,
# constexprs, num_warps), as each launcher makes them. Kept here, not in the kernel modules, whose bytes are sealed.
CASES = {"rmsnorm": _rmsnorm, "swiglu": _swiglu, "rope": _rope, "cross_entropy": _cross_entropy,
         "ce_chunk": _ce_chunk, "adamw": _adamw}


def _cases() -> list[tuple]:
    """The launches of every kernel of the switch table (:data:`forgetrain.kernels.KERNELS`): a kernel without an
    entry in :data:`CASES` is one failing row, so a new kernel cannot be left out of the check unnoticed."""
    from forgetrain.kernels import KERNELS, module_of

    out = []
    for name in KERNELS:
        out += CASES[name](module_of(name)) if name in CASES else [(f"{name}: no launches in CASES", None, {}, {}, 0)]
    return out


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
        if fn is None:
            out.append({"name": name, "ok": False, "s": 0.0, "error": "no launches for this kernel in aot_check.CASES"})
            continue
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
