"""Rotary position embedding, rotate-half form (Triton), replacing ``t * cos + rotate_half(t) * sin``.

Math (Su et al. 2021, "RoFormer", in the GPT-NeoX / Llama "rotate half" layout: the pair of dimension ``i`` is
``i + D/2``). With ``t = [t1, t2]`` split at ``D/2`` and ``cos = [c1, c2]``, ``sin = [s1, s2]`` likewise:

    out1 = t1 * c1 - t2 * s1             out2 = t2 * c2 + t1 * s2
    dt1  = dy1 * c1 + dy2 * s2           dt2  = dy2 * c2 - dy1 * s1      (the transpose of the rotation)

``cos``/``sin`` are fp32 ``[S, D]`` tables (for standard RoPE the two halves are equal, but they need not be),
row ``s`` used for sequence position ``s``. Arithmetic in fp32, one rounding to ``t.dtype``. The replaced op with
fp32 tables promotes to fp32 and casts back, i.e. the same math; they differ at most by FMA contraction.
"""

from __future__ import annotations

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["apply_rope", "make_apply_rope", "rope_tables", "SPEC"]


@triton.jit
def _rope_kernel(T, COS, SIN, OUT, stride_tb, stride_ts, stride_th, stride_ob, stride_os, stride_oh, stride_cs,
                 S, NH, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BACKWARD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    mask = (h[:, None] < NH) & dmask[None, :]
    c1 = tl.load(COS + s * stride_cs + d, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(COS + s * stride_cs + HALF + d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(SIN + s * stride_cs + d, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(SIN + s * stride_cs + HALF + d, mask=dmask, other=0.0)[None, :]
    t_ptr = T + b * stride_tb + s * stride_ts + h[:, None] * stride_th + d[None, :]
    t1 = tl.load(t_ptr, mask=mask, other=0.0).to(tl.float32)
    t2 = tl.load(t_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = t1 * c1 + t2 * s2
        o2 = t2 * c2 - t1 * s1
    else:
        o1 = t1 * c1 - t2 * s1
        o2 = t2 * c2 + t1 * s2
    o_ptr = OUT + b * stride_ob + s * stride_os + h[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


def _launch(kernel, t, cos, sin, backward: bool) -> torch.Tensor:
    B, S, NH, D = t.shape
    out = empty((B, S, NH, D), t.dtype, t.device)
    if t.numel() == 0:
        return out
    half = D // 2
    BLOCK_H = next_pow2(NH)
    BLOCK_D = next_pow2(half)
    kernel[(B * S,)](t, cos, sin, out, t.stride(0), t.stride(1), t.stride(2), out.stride(0), out.stride(1),
                     out.stride(2), cos.stride(0), S, NH, HALF=half, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                     BACKWARD=backward, num_warps=4 if BLOCK_H * BLOCK_D <= 2048 else 8)
    return out


def make_apply_rope(kernel=_rope_kernel):
    """Build the functional API around a kernel with ``_rope_kernel``'s signature (tests inject variants)."""

    class _RoPE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, cos, sin):
            ctx.save_for_backward(cos, sin)
            return _launch(kernel, t, cos, sin, backward=False)

        @staticmethod
        def backward(ctx, dy):
            cos, sin = ctx.saved_tensors
            if dy.stride(-1) != 1:
                dy = dy.contiguous()
            return _launch(kernel, dy, cos, sin, backward=True), None, None

    def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of ``t`` at positions ``0..S-1``.

        Args:
            t: ``[B, S, H, D]`` (bf16 / fp16 / fp32), D even; the last dim must be contiguous, other strides are
                free (q/k may be views into a fused qkv projection).
            cos, sin: fp32 ``[S_max, D]`` tables with ``S_max >= S`` (see :func:`rope_tables`); row ``s`` is used
                for position ``s``.
        Returns:
            ``[B, S, H, D]`` contiguous in ``t.dtype``. Backward returns ``dt`` only (the tables get no grad).
        Saved for backward: ``cos``, ``sin`` (no activation copy).
        Raises:
            ValueError: wrong ranks/shapes/dtypes, odd D, or unsupported device.
        """
        if t.dim() != 4:
            raise ValueError(f"t must be [B, S, H, D], got {tuple(t.shape)}")
        B, S, NH, D = t.shape
        if D % 2:
            raise ValueError(f"head dim must be even, got {D}")
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or cos.shape[0] < S:
            raise ValueError(f"cos/sin must be [>= {S}, {D}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"cos/sin must be float32, got {cos.dtype}/{sin.dtype}")
        if not t.is_floating_point():
            raise ValueError(f"t must be floating point, got {t.dtype}")
        check_device(t, cos, sin)
        if t.stride(-1) != 1:
            t = t.contiguous()
        cos = cos.contiguous()
        sin = sin.contiguous()
        return _RoPE.apply(t, cos, sin)

    return apply_rope


apply_rope = make_apply_rope()


def rope_tables(seq_len: int, head_dim: int, base: float = 500000.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[seq_len, head_dim]``: angle ``pos * base^(-2i/D)`` for ``i < D/2``,
    duplicated over the two halves (Llama convention; Llama 3 uses base 500000, Llama 2 10000). Frequencies and
    angles are computed in fp64 and rounded once."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    return lambda inp: {"y": fn(inp["t"], inp["cos"], inp["sin"])}


def _reference(inp):
    return {"y": torch_ops.apply_rope(inp["t"], inp["cos"], inp["sin"])}


def _oracle(inp):
    return _reference(inp)  # called on fp64 copies: the same formula in exact-ish arithmetic


def _make_inputs(shape, dtype, device, gen):
    B, S, NH, D = shape["batch"], shape["seq"], shape["heads"], shape["head_dim"]
    t = torch.randn(B, S, NH, D, generator=gen, device=device)
    # random positions offsets so small grids still see large angles (long-context rows)
    cos, sin = rope_tables(S + shape.get("offset", 0), D, device=device)
    off = shape.get("offset", 0)
    return {"t": t.to(dtype), "cos": cos[off:].contiguous(), "sin": sin[off:].contiguous()}


def _cost(shape, dtype):
    n = shape["batch"] * shape["seq"] * shape["heads"] * shape["head_dim"]
    tab = 2 * shape["seq"] * shape["head_dim"] * 4
    b = torch.tensor([], dtype=dtype).element_size()
    return {"fwd": {"bytes": 2 * n * b + tab, "flops": 3 * n}, "bwd": {"bytes": 2 * n * b + tab, "flops": 3 * n}}


SPEC = KernelSpec(
    name="rope",
    module=__name__,
    api="apply_rope(t [B, S, H, D], cos [S, D] fp32, sin [S, D] fp32) -> [B, S, H, D]",
    replaces="(t * cos + rotate_half(t) * sin).to(t.dtype)  # cos/sin fp32 [S, D] broadcast over B, H",
    candidate=candidate_from(apply_rope),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"t": "[batch, seq, heads, head_dim] dtype", "cos": "[seq, head_dim] fp32", "sin": "[seq, head_dim] fp32"},
    outputs={"y": "[batch, seq, heads, head_dim] dtype"},
    saved={"cos": "[seq, head_dim] fp32", "sin": "[seq, head_dim] fp32"},
    dtypes=(torch.bfloat16, torch.float16),
    shapes={
        "small": ({"batch": 2, "seq": 8, "heads": 4, "head_dim": 32, "offset": 4000},
                  {"batch": 1, "seq": 5, "heads": 3, "head_dim": 24}),
        "full": ({"batch": 1, "seq": 8192, "heads": 32, "head_dim": 128},
                 {"batch": 1, "seq": 8192, "heads": 8, "head_dim": 128},
                 {"batch": 2, "seq": 4096, "heads": 32, "head_dim": 128}),
        "bench": ({"batch": 1, "seq": 8192, "heads": 32, "head_dim": 128},
                  {"batch": 1, "seq": 8192, "heads": 8, "head_dim": 128}),
    },
    cost=_cost,
    differentiable=("t",),
    grad_outputs=("y",),
)
