"""SwiGLU activation (Triton), replacing ``F.silu(gate) * up``.

Math (Shazeer 2020, "GLU Variants Improve Transformer"; silu(g) = g * sigmoid(g)):

    y      = g * sigmoid(g) * u
    dgate  = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    dup    = dy * g * sigmoid(g)

All in fp32, rounded once to the input dtype. The replaced op rounds ``silu(g)`` to bf16 before the product
(and its backward rounds intermediate products too).
"""

from __future__ import annotations

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["swiglu", "make_swiglu", "SPEC"]


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, F_: int) -> torch.Tensor:
    """[..., F] -> [rows, F] without a copy when the last dim is contiguous and rows are uniformly strided."""
    try:
        t2 = t.view(-1, F_)
    except RuntimeError:
        t2 = t.reshape(-1, F_)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(F_: int) -> int:
    return min(1024, next_pow2(F_))


def make_swiglu(fwd_kernel=_swiglu_fwd_kernel, bwd_kernel=_swiglu_bwd_kernel):
    """Build the functional API around a (forward, backward) kernel pair (tests inject broken variants)."""

    class _SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up):
            F_ = gate.shape[-1]
            g2, u2 = _rows(gate, F_), _rows(up, F_)
            M = g2.shape[0]
            y = empty((M, F_), gate.dtype, gate.device)
            BLOCK = _block(F_)
            if M > 0 and F_ > 0:
                fwd_kernel[(M, triton.cdiv(F_, BLOCK))](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), F_,
                                                        BLOCK=BLOCK, num_warps=4)
            ctx.save_for_backward(g2, u2)
            ctx.shape = gate.shape
            return y.view(gate.shape)

        @staticmethod
        def backward(ctx, dy):
            g2, u2 = ctx.saved_tensors
            M, F_ = g2.shape
            dy2 = _rows(dy, F_)
            dg = empty((M, F_), g2.dtype, g2.device)
            du = empty((M, F_), u2.dtype, u2.device)
            BLOCK = _block(F_)
            if M > 0 and F_ > 0:
                bwd_kernel[(M, triton.cdiv(F_, BLOCK))](dy2, g2, u2, dg, du, dy2.stride(0), g2.stride(0),
                                                        u2.stride(0), dg.stride(0), du.stride(0), F_,
                                                        BLOCK=BLOCK, num_warps=4)
            return dg.view(ctx.shape), du.view(ctx.shape)

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in one pass.

        Args:
            gate, up: ``[..., F]``, same shape, same dtype (bf16 / fp16 / fp32). The last dim must be contiguous;
                rows may be strided, so the two halves of a fused ``[..., 2F]`` projection (``.chunk(2, -1)``)
                are read without a copy.
        Returns:
            ``[..., F]`` contiguous, in the input dtype. Backward returns contiguous ``dgate``, ``dup``.
        Saved for backward: ``gate``, ``up`` (no activation copy).
        Raises:
            ValueError: shape/dtype mismatch or unsupported device.
        """
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match")
        if not gate.is_floating_point():
            raise ValueError(f"swiglu needs floating point inputs, got {gate.dtype}")
        check_device(gate, up)
        return _SwiGLU.apply(gate, up)

    return swiglu


swiglu = make_swiglu()


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    return lambda inp: {"y": fn(inp["gate"], inp["up"])}


def _reference(inp):
    return {"y": torch_ops.swiglu(inp["gate"], inp["up"])}


def _oracle(inp):
    g = inp["gate"]
    return {"y": g * torch.sigmoid(g) * inp["up"]}


def _make_inputs(shape, dtype, device, gen):
    M, F_ = shape["tokens"], shape["ffn"]
    g = torch.randn(M, F_, generator=gen, device=device) * 2.0
    u = torch.randn(M, F_, generator=gen, device=device)
    return {"gate": g.to(dtype), "up": u.to(dtype)}


def _cost(shape, dtype):
    n = shape["tokens"] * shape["ffn"]
    b = torch.tensor([], dtype=dtype).element_size()
    return {"fwd": {"bytes": 3 * n * b, "flops": 5 * n}, "bwd": {"bytes": 5 * n * b, "flops": 12 * n}}


SPEC = KernelSpec(
    name="swiglu",
    module=__name__,
    api="swiglu(gate [..., F], up [..., F]) -> y [..., F]",
    replaces="F.silu(gate) * up",
    candidate=candidate_from(swiglu),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"gate": "[tokens, ffn] dtype", "up": "[tokens, ffn] dtype"},
    outputs={"y": "[tokens, ffn] dtype"},
    saved={"gate": "[tokens, ffn] dtype", "up": "[tokens, ffn] dtype"},
    dtypes=(torch.bfloat16, torch.float16),
    shapes={
        "small": ({"tokens": 16, "ffn": 384}, {"tokens": 7, "ffn": 1100}),
        "full": ({"tokens": 4096, "ffn": 8192}, {"tokens": 8192, "ffn": 14336}),
    },
    cost=_cost,
    differentiable=("gate", "up"),
    grad_outputs=("y",),
)
