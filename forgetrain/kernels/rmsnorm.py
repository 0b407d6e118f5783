"""RMSNorm with a fused residual add (Triton), replacing ``s = x + residual; F.rms_norm(s, (H,), weight, eps)``.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; the pre-norm residual form of Llama):

    s    = x + residual                      (rounded to x.dtype: this is the residual stream that is kept)
    rstd = 1 / sqrt(mean_j(s_j^2) + eps)     (fp32)
    y    = s * rstd * weight                 (fp32, rounded once to x.dtype)

Backward, with n = s * rstd and upstream gradients dy (of y) and ds_out (of the returned residual):

    dn  = dy * weight
    ds  = rstd * (dn - n * mean_j(dn_j * n_j)) + ds_out,   dx = dresidual = ds
    dw  = sum_rows(dy * n)                                  (fp32 partial sums per program, then summed)

Everything is computed in fp32 from the stored (rounded) ``s``, so ``y`` is exactly the normalisation of the
residual stream that is returned, and the fp64 oracle is defined the same way (it rounds ``x + residual`` to the
storage dtype, then is exact). Each output is rounded once to ``x.dtype``. In the replaced op's backward, the
gradient of the norm is rounded to ``x.dtype`` before autograd adds the residual's gradient, which loses the
low bits where the two nearly cancel; the kernel adds them in fp32 and rounds once.
"""

from __future__ import annotations

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["rmsnorm_residual", "make_rmsnorm_residual", "SPEC"]


@triton.jit
def _rmsnorm_fwd_kernel(X, R, W, Y, S, RSTD, stride_x, stride_r, stride_y, stride_s, H, eps,
                        HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s_low = (s + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s_low, mask=mask)
        s = s_low.to(tl.float32)
    ms = tl.sum(s * s, axis=0) / H
    rstd = tl.rsqrt(ms + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = s * rstd * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(DY, DSO, S, W, RSTD, DX, DR, DWP, stride_dy, stride_dso, stride_s, stride_dx, stride_dr,
                        M, H, rows_per_prog,
                        HAS_DSO: tl.constexpr, HAS_DR: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    row0 = pid.to(tl.int64) * rows_per_prog
    for i in range(0, rows_per_prog):
        row = row0 + i
        ok = row < M
        mask = cmask & ok
        s = tl.load(S + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=ok, other=0.0)
        n = s * rstd
        dn = dy * w
        c = tl.sum(dn * n, axis=0) / H
        ds = rstd * (dn - n * c)
        if HAS_DSO:
            ds += tl.load(DSO + row * stride_dso + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, ds.to(DX.dtype.element_ty), mask=mask)
        if HAS_DR:
            tl.store(DR + row * stride_dr + cols, ds.to(DR.dtype.element_ty), mask=mask)
        dw += dy * n
    tl.store(DWP + pid * H + cols, dw, mask=cmask)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


_SM_COUNT: dict = {}


def _programs(device: torch.device, rows: int) -> int:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return max(1, min(rows, 2 * _SM_COUNT[idx]))
    return max(1, min(rows, 4))


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def make_rmsnorm_residual(fwd_kernel=_rmsnorm_fwd_kernel, bwd_kernel=_rmsnorm_bwd_kernel):
    """Build the functional API around a (forward, backward) kernel pair with the signatures above.

    The default pair is the production kernel; tests pass deliberately broken variants to prove validation
    rejects them.
    """

    class _RMSNormResidual(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, weight, eps):
            H = x.shape[-1]
            x2 = _rows(x, H)
            M = x2.shape[0]
            has_res = residual is not None
            r2 = _rows(residual, H) if has_res else x2
            y = empty((M, H), x.dtype, x.device)
            s = empty((M, H), x.dtype, x.device) if has_res else x2
            rstd = empty((M,), torch.float32, x.device)
            BLOCK_H = next_pow2(H)
            if M > 0:
                fwd_kernel[(M,)](x2, r2, weight, y, s, rstd, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
                                 H, float(eps), HAS_RES=has_res, BLOCK_H=BLOCK_H, num_warps=_num_warps(BLOCK_H))
            ctx.save_for_backward(s, weight, rstd)
            ctx.has_res = has_res
            ctx.x_shape = x.shape
            ctx.x_dtype = x.dtype
            ctx.r_dtype = residual.dtype if has_res else None
            y = y.view(x.shape)
            if has_res:
                return y, s.view(x.shape)
            return y, None

        @staticmethod
        def backward(ctx, dy, ds_out):
            s, weight, rstd = ctx.saved_tensors
            M, H = s.shape
            dy2 = _rows(dy, H)
            has_dso = ds_out is not None and ctx.has_res
            dso2 = _rows(ds_out, H) if has_dso else dy2
            need_dr = ctx.has_res and ctx.needs_input_grad[1]
            dx = empty((M, H), ctx.x_dtype, s.device)
            dr = empty((M, H), ctx.r_dtype, s.device) if need_dr else dx
            P = _programs(s.device, M)
            rows_per_prog = -(-M // P) if M else 0
            dwp = empty((P, H), torch.float32, s.device)
            BLOCK_H = next_pow2(H)
            if M > 0:
                bwd_kernel[(P,)](dy2, dso2, s, weight, rstd, dx, dr, dwp, dy2.stride(0), dso2.stride(0), s.stride(0),
                                 dx.stride(0), dr.stride(0), M, H, rows_per_prog,
                                 HAS_DSO=has_dso, HAS_DR=need_dr, BLOCK_H=BLOCK_H, num_warps=_num_warps(BLOCK_H))
                dw = dwp.sum(0).to(weight.dtype)
            else:
                dw = torch.zeros_like(weight)
            shape = ctx.x_shape
            return (dx.view(shape), dr.view(shape) if need_dr else None,
                    dw if ctx.needs_input_grad[2] else None, None)

    def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``s = x + residual; y = rms_norm(s) * weight``; returns ``(y, s)``.

        Args:
            x: ``[..., H]`` activations, bf16 / fp16 / fp32; the last dim must be contiguous (rows may be strided).
            residual: ``[..., H]`` residual stream, same shape and dtype as ``x``; or ``None`` (first layer), in
                which case ``s`` is ``x`` itself.
            weight: ``[H]`` gain (any float dtype; upcast to fp32 inside).
            eps: added to the mean square (Llama: 1e-5; note F.rms_norm's default ``None`` means finfo(dtype).eps).
        Returns:
            ``y`` ``[..., H]`` in ``x.dtype``, and ``s = x + residual`` ``[..., H]`` in ``x.dtype`` (the new residual).
        Saved for backward: ``s`` (x.dtype), ``weight``, ``rstd`` (fp32 ``[rows]``).
        Raises:
            ValueError: on shape/dtype mismatch or tensors on different/unsupported devices.
        """
        H = x.shape[-1]
        if weight.dim() != 1 or weight.shape[0] != H:
            raise ValueError(f"weight must be [{H}], got {tuple(weight.shape)}")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x "
                             f"{tuple(x.shape)}/{x.dtype}")
        if not x.is_floating_point():
            raise ValueError(f"x must be floating point, got {x.dtype}")
        check_device(x, weight, *([residual] if residual is not None else []))
        y, s = _RMSNormResidual.apply(x, residual, weight, eps)
        return y, (s if residual is not None else x)

    return rmsnorm_residual


rmsnorm_residual = make_rmsnorm_residual()


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    def _candidate(inp):
        y, s = fn(inp["x"], inp["residual"], inp["weight"], inp["eps"])
        return {"y": y, "residual_out": s}
    return _candidate


def _reference(inp):
    y, s = torch_ops.rmsnorm_residual(inp["x"], inp["residual"], inp["weight"], inp["eps"])
    return {"y": y, "residual_out": s}


def _oracle(inp):
    """Exact in fp64, for the contract's ``s``: the residual is *returned in x.dtype*, and ``y`` is the norm of
    that stored residual, so the oracle rounds ``x + residual`` to the storage dtype (a straight-through rounding:
    the gradient stays exact). Without this, every implementation inherits the same O(u) perturbation of ``s``,
    amplified by the cancellation in ``dx``, and comparing two implementations' errors is luck."""
    s = inp["x"] + inp["residual"]
    s = s + (s.to(inp["storage_dtype"]).to(s.dtype) - s).detach()
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + inp["eps"])
    return {"y": s * rstd * inp["weight"], "residual_out": s}


def _make_inputs(shape, dtype, device, gen):
    """Rows of a residual stream: per-row scales spread log-normally (e^N(0,1): ~0.1x to ~10x), so some rows
    have a small mean square where the epsilon matters, as real token norms do."""
    M, H = shape["tokens"], shape["hidden"]

    def rn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    row_scale = torch.exp(rn(M, 1))
    return {
        "x": (rn(M, H) * row_scale).to(dtype),
        "residual": (rn(M, H) * 2.0 * row_scale).to(dtype),
        "weight": (1.0 + 0.1 * rn(H)).to(dtype),
        "eps": 1e-5,
        "storage_dtype": dtype,
    }


def _cost(shape, dtype):
    M, H = shape["tokens"], shape["hidden"]
    b = torch.tensor([], dtype=dtype).element_size()
    return {"fwd": {"bytes": 4 * M * H * b + H * b + 4 * M, "flops": 4 * M * H},
            "bwd": {"bytes": 5 * M * H * b + H * b + 4 * M, "flops": 8 * M * H}}


SPEC = KernelSpec(
    name="rmsnorm",
    module=__name__,
    api="rmsnorm_residual(x [..., H], residual [..., H] | None, weight [H], eps) -> (y [..., H], s [..., H])",
    replaces="s = x + residual; y = F.rms_norm(s, (H,), weight, eps)",
    candidate=candidate_from(rmsnorm_residual),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"x": "[tokens, hidden] dtype", "residual": "[tokens, hidden] dtype", "weight": "[hidden] dtype",
            "eps": "float (1e-5)", "storage_dtype": "dtype (for the oracle: s is stored in it)"},
    outputs={"y": "[tokens, hidden] dtype", "residual_out": "[tokens, hidden] dtype (x + residual)"},
    saved={"s": "[tokens, hidden] dtype (the returned residual)", "weight": "[hidden]", "rstd": "[tokens] fp32"},
    dtypes=(torch.bfloat16, torch.float16),
    shapes={
        "small": ({"tokens": 24, "hidden": 256}, {"tokens": 19, "hidden": 200}, {"tokens": 16, "hidden": 1024}),
        "full": ({"tokens": 4096, "hidden": 2048}, {"tokens": 8192, "hidden": 4096}),
    },
    cost=_cost,
    differentiable=("x", "residual", "weight"),
    grad_outputs=("y", "residual_out"),
)
