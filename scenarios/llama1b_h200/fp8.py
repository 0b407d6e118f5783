"""FP8 GEMMs for the decoder layers' linear layers of the fast Hopper engine (``engine.fp8=tensorwise``).

Each of ``attn.qkv``, ``attn.proj``, ``mlp.fc1`` and ``mlp.fc2`` runs its three GEMMs with FP8 operands through
``torch._scaled_mm`` (cuBLASLt's FP8 GEMM on Hopper, fp32 accumulation inside the GEMM):

* forward ``y = x @ w^T``: ``x`` and ``w`` in e4m3 (3 mantissa bits, range 448), ``y`` in x's dtype;
* input gradient ``dx = dy @ w``: ``dy`` in e5m2 (2 mantissa bits, range 57344: gradients need range more than
  precision), ``w`` in e4m3, ``dx`` in x's dtype;
* weight gradient ``dw = dy^T @ x``: ``dy`` e5m2, ``x`` e4m3, ``dw`` in fp32, then written into (first
  micro-batch) or added to the fp32 ``main_grad`` under ``engine.grad_accum_fusion``, else returned as ``w``'s
  gradient in its dtype.

Scaling is dynamic and per tensor ("tensorwise", the recipe of NVIDIA's Transformer Engine ``Float8CurrentScaling``
and of torchao's float8 ``tensorwise``): each operand is multiplied by ``fmax / amax(|t|)`` before the cast, so its
largest magnitude lands on the format's largest finite value, and the GEMM multiplies the product by the two
inverse scales. No amax history (delayed scaling) is kept, so a step depends only on its own tensors. The scale
is a power of two when ``POW2_SCALES`` is set (it is: multiplying by a power of two is exact in every format, so
quantisation error comes from the FP8 rounding alone; torchao's ``round_scales_to_power_of_2``).

What stays in bf16: the embedding, the LM head and its cross-entropy (the logits' precision matters most; FP8
recipes exclude the output layer), attention's score and value products (SDPA), the norms and SwiGLU. The LM head's
three GEMMs can run in FP8 too with ``engine.fp8_lm_head=true`` (:class:`HeadWeight`, the chunked cross-entropy of
``fast.py``; its own loss-curve entry, ``fp8_lm_head``): the LM head is about a third of an 8B-proxy step's FLOPs. Saved for the
backward: ``x`` (transposed) and ``w`` in e4m3 with their scales (1 byte per element instead of 2).

Tier: **loss_curve**. FP8 rounding of every GEMM operand changes each step's numbers by far more than the
tolerance tier's bounds; what it must keep is the loss trajectory inside the reference's seed-to-seed band
(``optimisations.yaml``: ``fp8_linear``). MFU stays counted against the bf16 dense peak of the device, as
torchtitan reports its float8 runs, and is labelled so in benchmarks.

Shapes: ``x [..., in]`` (leading dims flattened to tokens), ``w [out, in]``, ``main_grad [out, in]`` fp32.
cuBLASLt's FP8 GEMM needs every dimension a multiple of 16 and the second operand column-major: the functions
below lay the operands out so, padding the token dimension with zero rows where needed (:func:`_pad_rows`); the
weight's dimensions are checked once (:func:`check_shape` raises ValueError).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn  # activations and weights
E5M2 = torch.float8_e5m2  # gradients
POW2_SCALES = True  # round every scale down to a power of two (exact scaling; see the module docstring)
_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (its FP8 image is zero either way)


def check_shape(in_features: int, out_features: int) -> None:
    """Raise ValueError unless both dimensions are multiples of 16 (cuBLASLt's FP8 GEMM requirement)."""
    if in_features % 16 or out_features % 16:
        raise ValueError(f"engine.fp8 needs linear dimensions that are multiples of 16, got [{out_features}, "
                         f"{in_features}]")


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t8, inv_scale)``: ``t`` scaled by ``s = fmax / amax(|t|)`` (rounded down to a power of two when
    :data:`POW2_SCALES`), saturated to ``[-fmax, fmax]`` and cast to ``dtype`` (``E4M3`` or ``E5M2``);
    ``inv_scale = 1 / s`` as a 0-d fp32 tensor, so ``t ~ t8.float() * inv_scale``. ``t`` any float dtype/shape."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax().float().clamp(min=_EPS)
    scale = fmax / amax
    if POW2_SCALES:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    t8 = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale.reciprocal()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [T, k]`` with zero rows appended up to a multiple of 16 (cuBLASLt's FP8 GEMM needs every dimension so;
    a generation step or a short sequence has any T). Exact: zero rows change no amax and no other row's product,
    and the extra output rows are cut off. ``t`` itself when T already is a multiple of 16."""
    pad = -t.shape[0] % 16
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix ``[r, c]`` stored column-major (``t.t().contiguous().t()``)."""
    return t.t().contiguous().t()


def _mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor, out_dtype) -> torch.Tensor:
    """``(a8 * sa) @ (b8 * sb)`` for ``a8 [m, k]`` row-major and ``b8 [k, n]`` column-major, fp32 accumulation."""
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def wgrad(dy8t: torch.Tensor, sdy: torch.Tensor, x8t: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
    """``dw = (dy8t * sdy) @ (x8t * sx)^T`` in fp32 ``[out, in]``, from the transposed FP8 operands ``dy8t [out, T]``
    (e5m2) and ``x8t [in, T]`` (e4m3), both row-major: ``x8t.t()`` is then the column-major ``[T, in]`` the GEMM
    takes as its second operand, so no layout change happens here."""
    return _mm(dy8t, sdy, x8t.t(), sx, torch.float32)


@torch.library.custom_op("forgetrain::fp8_wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: torch.Tensor, dy8t: torch.Tensor, sdy: torch.Tensor, x8t: torch.Tensor,
                     sx: torch.Tensor, overwrite: bool) -> None:
    """``main_grad = [0 if overwrite else main_grad] + wgrad(dy8t, sdy, x8t, sx)``, fp32 ``[out, in]``, in place; an
    opaque op so that ``torch.compile`` keeps the mutation of the engine's buffer as one call (as ``wgrad.py``).
    Its operands arrive already transposed: the transposes are made in the (compiled) backward, where inductor
    fuses them with the quantisation, not here in eager code (whose FP8 transpose copies ran at about 1 TB/s)."""
    dw = wgrad(dy8t, sdy, x8t, sx)
    if overwrite:
        main_grad.copy_(dw)
    else:
        main_grad.add_(dw)


@wgrad_accumulate.register_fake
def _(main_grad, dy8t, sdy, x8t, sx, overwrite) -> None:
    return None


class Fp8Linear(torch.autograd.Function):
    """``y = x @ w^T`` with FP8 operands (module docstring). ``main_grad`` (fp32 ``[out, in]``) and
    ``overwrite``: with a ``main_grad`` the weight gradient is written (``overwrite``) or added there and ``w``
    gets no gradient (gradient accumulation fusion); without, ``w``'s gradient is returned in ``w``'s dtype.
    Saved for the backward: ``x`` in e4m3, transposed (``[in, T]``, the layout the weight-gradient GEMM reads),
    and ``w`` in e4m3, with their scales."""

    @staticmethod
    def forward(ctx, x, w, main_grad, overwrite: bool):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = _pad_rows(x.reshape(-1, k))
        x8, sx = quantize(x2, E4M3)
        w8, sw = quantize(w, E4M3)
        y = _mm(x8, sx, w8.t(), sw, x.dtype)  # w8 [out, in] row-major: w8.t() is [in, out] column-major
        ctx.save_for_backward(x8.t().contiguous(), sx, w8, sw)
        ctx.main_grad, ctx.overwrite, ctx.dtypes = main_grad, overwrite, (x.dtype, w.dtype)
        return y[:lead.numel()].view(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x8t, sx, w8, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        lead, n = dy.shape[:-1], dy.shape[-1]
        dy8, sdy = quantize(_pad_rows(dy.reshape(-1, n)), E5M2)
        dx = _mm(dy8, sdy, _col_major(w8), sw, x_dtype)[:lead.numel()].view(*lead, w8.shape[1])
        dy8t = dy8.t().contiguous()
        if ctx.main_grad is None:
            return dx, wgrad(dy8t, sdy, x8t, sx).to(w_dtype), None, None
        wgrad_accumulate(ctx.main_grad, dy8t, sdy, x8t, sx, ctx.overwrite)
        return dx, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor | None = None, overwrite: bool = False):
    """``F.linear(x, w)`` with FP8 GEMMs (:class:`Fp8Linear`); ``x [..., in]``, ``w [out, in]`` -> ``[..., out]``."""
    return Fp8Linear.apply(x, w, main_grad, overwrite)


class HeadWeight:
    """The LM head's weight ``w [V, h]`` in e4m3 for one forward of the chunked cross-entropy
    (``engine.fp8_lm_head``): quantised once, then each token chunk's three GEMMs run in FP8 with the recipe above.

    ``logits(hc)``: ``hc [n, h]`` -> (``[n, V]`` in hc's dtype, the chunk's e4m3 operand and scale);
    ``dh(g)``: ``g [n, V]`` (d loss / d logits) -> (``[n, h]`` in g's dtype, g's e5m2 operand and scale);
    ``dw(g8, sg, x8, sx, n)``: the chunk's weight gradient ``g^T hc`` ``[V, h]`` in fp32 from those operands.
    Rows are padded to a multiple of 16 as in :class:`Fp8Linear` (exact) and cut off again."""

    def __init__(self, w: torch.Tensor):
        self.w8, self.sw = quantize(w, E4M3)  # [V, h] row-major: w8.t() is the logits GEMM's column-major operand
        self.w8_col = _col_major(self.w8)  # [V, h] column-major: the operand of d(h) = g @ w

    def logits(self, hc: torch.Tensor):
        x8, sx = quantize(_pad_rows(hc), E4M3)
        return _mm(x8, sx, self.w8.t(), self.sw, hc.dtype)[:hc.shape[0]], x8, sx

    def dh(self, g: torch.Tensor):
        g8, sg = quantize(_pad_rows(g), E5M2)
        return _mm(g8, sg, self.w8_col, self.sw, g.dtype)[:g.shape[0]], g8, sg

    @staticmethod
    def dw(g8: torch.Tensor, sg: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        return wgrad(g8.t().contiguous(), sg, x8.t().contiguous(), sx)  # padded rows are zero in both: exact
