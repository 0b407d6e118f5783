"""Make Triton's CPU interpreter round bf16 the way the GPU does (CPU validation only).

Why: Triton 3.x's interpreter (``TRITON_INTERPRET=1``) stores bf16 as raw ``uint16`` and

* converts fp32 -> bf16 by *truncating* the mantissa (``x.to(tl.bfloat16)``); with
  ``fp_downcast_rounding="rtne"`` it rounds half-up and drops the mantissa carry for odd exponents.
  The GPU (``cvt.rn.bf16.f32``) rounds to nearest, ties to even. Truncation biases every bf16 output by
  half an ulp, so a correct kernel would fail validation against ``torch`` (which rounds to nearest);
* cannot use a runtime scalar as a loop bound under numpy 2 (``int()`` of a 1-element array);
* evaluates ``tl.fma`` as a separately rounded multiply and add;
* does bf16 arithmetic (``a + b`` with bf16 operands, ``tl.dot`` on bf16) on the integer bit patterns,
  which yields garbage. The GPU computes these in hardware bf16 (round to nearest even).

:func:`apply` replaces, inside ``triton.runtime.interpreter`` only, the fp32<->bf16 conversion and the bf16
paths of binary/unary ops and ``dot`` with exact numpy emulations: arithmetic is done in fp32 and rounded to
bf16 with round-to-nearest-even (the same result as native bf16 for a single add/mul of bf16 operands, up to a
double rounding that needs the operands' exponents more than 16 apart). Nothing changes when kernels are
compiled for a GPU. :func:`self_check` verifies the emulation against ``torch``'s own bf16 rounding; the
validator calls it before trusting any CPU result and raises ``RuntimeError`` when it fails (for example on
a Triton version whose interpreter internals moved).
"""

from __future__ import annotations

import numpy as np

_APPLIED = False


def f32_to_bf16_bits(a: np.ndarray, rtz: bool = False) -> np.ndarray:
    """fp32 array -> bf16 bit patterns (uint16), round to nearest even (or toward zero); NaN stays NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    if rtz:
        out = (u >> 16).astype(np.uint16)
    else:
        out = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if np.any(nan):
        out = np.where(nan, ((u >> 16) | np.uint32(0x0040)).astype(np.uint16), out)
    return out.reshape(np.shape(a))


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> fp32 (exact)."""
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(b))


def apply() -> None:
    """Patch ``triton.runtime.interpreter`` in place (idempotent). Only call when interpreting."""
    global _APPLIED
    if _APPLIED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as I
    from triton._C.libtriton import ir as _ir

    orig_convert = I._convert_float
    orig_binary = I.InterpreterBuilder.binary_op
    orig_unary = I.InterpreterBuilder.unary_op
    orig_dot = I.InterpreterBuilder.create_dot
    TH = I.TensorHandle
    arith = {np.add, np.subtract, np.multiply, np.divide, np.fmod, np.minimum, np.maximum}

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            rtz = rounding_mode is not None and rounding_mode == _ir.ROUNDING_MODE.RTZ
            return f32_to_bf16_bits(np.asarray(input).view(np.float32), rtz=rtz)
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            return bf16_bits_to_f32(np.asarray(input).view(np.uint16)).view(np.uint32)
        if input_dtype == tl.bfloat16:  # bf16 -> other float: go through exact fp32
            f = bf16_bits_to_f32(np.asarray(input).view(np.uint16))
            return orig_convert(f, tl.float32, output_dtype, rounding_mode)
        if output_dtype == tl.bfloat16 and input_dtype.is_floating():  # other float -> bf16 via fp32
            f = np.asarray(input).view(I._get_np_dtype(input_dtype)).astype(np.float32)
            return f32_to_bf16_bits(f)
        return orig_convert(input, input_dtype, output_dtype, rounding_mode)

    def _is_bf16(h):
        return getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16

    def binary_op(self, lhs, rhs, op):
        if _is_bf16(lhs) and _is_bf16(rhs):
            a = bf16_bits_to_f32(lhs.data)
            b = bf16_bits_to_f32(rhs.data)
            if op in arith:
                return TH(f32_to_bf16_bits(op(a, b)), tl.bfloat16)
            return orig_binary(self, TH(a, tl.float32), TH(b, tl.float32), op)
        return orig_binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if _is_bf16(arg):
            return TH(f32_to_bf16_bits(op(bf16_bits_to_f32(arg.data)).astype(np.float32)), tl.bfloat16)
        return orig_unary(self, arg, op)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if _is_bf16(a):
            a = TH(bf16_bits_to_f32(a.data), tl.float32)
        if _is_bf16(b):
            b = TH(bf16_bits_to_f32(b.data), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    orig_patch_tensor = I._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        # numpy >= 2.? refuses int() of a 1-element 1-D array; the interpreter keeps scalars as such arrays, so
        # `range(runtime_scalar)` inside a kernel failed.
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def create_fma(self, x, y, z):
        # a fused multiply-add rounds once; numpy's x * y + z in fp32 rounds twice. The fp64 product of two fp32
        # values is exact, so only the final add can double-round (ties at fp32 precision: negligible).
        if x.data.dtype == np.float32:
            r = (x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64))
            return TH(r.astype(np.float32), z.dtype.scalar)
        if _is_bf16(x):
            r = bf16_bits_to_f32(x.data).astype(np.float64) * bf16_bits_to_f32(y.data) + bf16_bits_to_f32(z.data)
            return TH(f32_to_bf16_bits(r.astype(np.float32)), tl.bfloat16)
        return TH(x.data * y.data + z.data, z.dtype.scalar)

    I.InterpreterBuilder.create_fma = create_fma
    I._patch_lang_tensor = _patch_lang_tensor
    I._convert_float = _convert_float
    I.InterpreterBuilder.binary_op = binary_op
    I.InterpreterBuilder.unary_op = unary_op
    I.InterpreterBuilder.create_dot = create_dot
    _APPLIED = True


def self_check() -> None:
    """Run a tiny interpreted kernel and compare its bf16 results with torch; raise RuntimeError on mismatch."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, y_ptr, cast_ptr, add_ptr, mul_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        y = tl.load(y_ptr + offs, mask=m, other=0.0)
        tl.store(cast_ptr + offs, x.to(tl.bfloat16), mask=m)
        xb = x.to(tl.bfloat16)
        yb = y.to(tl.bfloat16)
        tl.store(add_ptr + offs, xb + yb, mask=m)
        tl.store(mul_ptr + offs, xb * yb, mask=m)

    g = torch.Generator().manual_seed(1234)
    n = 4096
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    y = torch.randn(n, generator=g)
    # exact ties and mantissa carries: x = bf16 value + half an ulp, odd exponents
    x[:256] = (torch.arange(256, dtype=torch.float32) + 0.5) / 128 + 1.0
    x[256] = float("inf")
    x[257] = float("nan")
    outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(3)]
    _probe[(1,)](x, y, *outs, n, BLOCK=n)
    xb, yb = x.bfloat16(), y.bfloat16()
    want = [xb, xb + yb, xb * yb]
    for name, got, exp in zip(("cast", "add", "mul"), outs, want):
        differ = (got.view(torch.int16) != exp.view(torch.int16)) & ~(got.isnan() & exp.isnan())
        if bool(differ.any()):
            bad = int(differ.sum())
            raise RuntimeError(f"Triton interpreter bf16 {name} disagrees with torch on {bad}/{n} elements; "
                               f"the CPU emulation in forgetrain/kernels/_interp.py does not fit this Triton version")
