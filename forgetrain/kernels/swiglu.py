"""SwiGLU activation (Triton), replacing ``F.silu(gate) * up``.

Math (Shazeer 2020, "GLU Variants Improve Transformer"; silu(g) = g * sigmoid(g)):

    y      = g * sigmoid(g) * u
    dgate  = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    dup    = dy * g * sigmoid(g)

All in fp32, rounded once to the input dtype. The replaced op rounds ``silu(g)`` to bf16 before the product
(and its backward rounds intermediate products too).

Two entry points share the forward kernel and the backward's arithmetic (``_swiglu_grads``): ``swiglu(gate, up)``,
and ``swiglu_packed(x)`` for the fused fc1 output ``x = [gate | up]`` ``[..., 2F]``, whose backward kernel writes both
halves of ``dx``, passed whole, in one pass. With
``swiglu`` on ``x.chunk(2, -1)``, autograd's chunk backward concatenates ``dgate`` and ``dup`` into ``dx``: one more
read and write of ``[tokens, 2F]`` per layer and micro-batch (the H200 profile of the 8B proxy, 2026-12-02: the
compiled ``cat``-fused SwiGLU backward moved its data at about 2 TB/s).
"""

from __future__ import annotations

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["swiglu", "swiglu_packed", "make_swiglu", "SPEC"]


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
def _swiglu_grads(dy, g, u):
    """(dgate, dup) in fp32 from fp32 ``dy``, ``g``, ``u``: the one statement of the backward's arithmetic."""
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    return dg, du


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dg, du = _swiglu_grads(dy, g, u)
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_packed_bwd_kernel(DY, X, DX, stride_dy, stride_x, stride_dx, n_cols, BLOCK: tl.constexpr):
    """The packed backward: gate and up are columns [0, F) and [F, 2F) of each row of X, and dgate and dup go
    to the same columns of DX. DX is one whole tensor, not two column slices: a compiled graph clones each
    mutated slice a user Triton kernel writes and scatters it back (three copy kernels per call, 21 ms of a
    1.06 s step of the 8B proxy on the H200, 2026-12-03), while a whole fresh tensor is written in place."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dg, du = _swiglu_grads(dy, g, u)
    tl.store(DX + row * stride_dx + cols, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + n_cols + cols, du.to(DX.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, F_: int) -> torch.Tensor:
    """[..., F] -> [rows, F] without a copy when the last dim is contiguous and rows are uniformly strided."""
    try:
        t2 = t.view(-1, F_)
    except RuntimeError:
        t2 = t.reshape(-1, F_)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(F_: int) -> int:
    return min(1024, next_pow2(F_))


def make_swiglu(fwd_kernel=_swiglu_fwd_kernel, bwd_kernel=_swiglu_bwd_kernel,
                packed_bwd_kernel=_swiglu_packed_bwd_kernel):
    """Build the functional API around its kernels: the forward, the backward and the packed backward (tests
    inject broken variants)."""

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

    class _SwiGLUPacked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            F_ = x.shape[-1] // 2
            x2 = _rows(x, 2 * F_)
            M = x2.shape[0]
            y = empty((M, F_), x.dtype, x.device)
            BLOCK = _block(F_)
            if M > 0 and F_ > 0:
                fwd_kernel[(M, triton.cdiv(F_, BLOCK))](x2[:, :F_], x2[:, F_:], y, x2.stride(0), x2.stride(0),
                                                        y.stride(0), F_, BLOCK=BLOCK, num_warps=4)
            ctx.save_for_backward(x2)
            ctx.shape = x.shape
            return y.view(*x.shape[:-1], F_)

        @staticmethod
        def backward(ctx, dy):
            (x2,) = ctx.saved_tensors
            M, F2 = x2.shape
            F_ = F2 // 2
            dy2 = _rows(dy, F_)
            dx = empty((M, F2), x2.dtype, x2.device)
            BLOCK = _block(F_)
            if M > 0 and F_ > 0:  # dgate and dup straight into the two halves of dx, passed whole
                packed_bwd_kernel[(M, triton.cdiv(F_, BLOCK))](dy2, x2, dx, dy2.stride(0), x2.stride(0),
                                                               dx.stride(0), F_, BLOCK=BLOCK, num_warps=4)
            return dx.view(ctx.shape)

    def swiglu_packed(x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate, up = x.chunk(2, -1)``, in one pass each way.

        Args:
            x: ``[..., 2F]`` (the fused fc1 output ``[gate | up]``), bf16 / fp16 / fp32, last dim contiguous.
        Returns:
            ``[..., F]`` contiguous, in x's dtype. Backward returns ``dx [..., 2F]`` contiguous, both halves written
            by one kernel (no concatenation). Saved for backward: ``x`` (no activation copy).
        Raises:
            ValueError: an odd last dim, a non-floating dtype, or an unsupported device.
        """
        if x.shape[-1] % 2:
            raise ValueError(f"swiglu_packed needs an even last dim [..., 2F], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"swiglu_packed needs a floating point input, got {x.dtype}")
        check_device(x)
        return _SwiGLUPacked.apply(x)

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

    swiglu.packed = swiglu_packed  # the same kernels behind the packed entry point (validated together: SPEC)
    return swiglu


swiglu = make_swiglu()
swiglu_packed = swiglu.packed


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    """Both entry points of ``fn`` (a :func:`make_swiglu` result): ``y`` from ``fn(gate, up)``, ``y_packed`` from
    ``fn.packed(x_packed)``, on inputs of their own (each gradient is judged alone: dgate, dup, dx_packed)."""
    return lambda inp: {"y": fn(inp["gate"], inp["up"]), "y_packed": fn.packed(inp["x_packed"])}


def _reference(inp):
    # the engine's torch path for the packed input: the fc1 output, chunked, then silu(gate) * up
    return {"y": torch_ops.swiglu(inp["gate"], inp["up"]),
            "y_packed": torch_ops.swiglu(*inp["x_packed"].chunk(2, dim=-1))}


def _oracle(inp):
    g, u = inp["gate"], inp["up"]
    gp, up = inp["x_packed"].chunk(2, dim=-1)
    return {"y": g * torch.sigmoid(g) * u, "y_packed": gp * torch.sigmoid(gp) * up}


def _make_inputs(shape, dtype, device, gen):
    M, F_ = shape["tokens"], shape["ffn"]
    g = torch.randn(M, F_, generator=gen, device=device) * 2.0
    u = torch.randn(M, F_, generator=gen, device=device)
    x = torch.cat([torch.randn(M, F_, generator=gen, device=device) * 2.0,
                   torch.randn(M, F_, generator=gen, device=device)], dim=-1)
    return {"gate": g.to(dtype), "up": u.to(dtype), "x_packed": x.to(dtype)}


def _cost(shape, dtype):
    n = shape["tokens"] * shape["ffn"]
    b = torch.tensor([], dtype=dtype).element_size()
    # both entry points (y and y_packed), each 3 tensors of n elements forward and 5 backward
    return {"fwd": {"bytes": 2 * 3 * n * b, "flops": 2 * 5 * n}, "bwd": {"bytes": 2 * 5 * n * b, "flops": 2 * 12 * n}}


SPEC = KernelSpec(
    name="swiglu",
    module=__name__,
    api="swiglu(gate [..., F], up [..., F]) -> y [..., F]; swiglu_packed(x [..., 2F]) -> y [..., F]",
    replaces="F.silu(gate) * up",
    candidate=candidate_from(swiglu),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"gate": "[tokens, ffn] dtype", "up": "[tokens, ffn] dtype",
            "x_packed": "[tokens, 2 * ffn] dtype ([gate | up] for swiglu_packed)"},
    outputs={"y": "[tokens, ffn] dtype", "y_packed": "[tokens, ffn] dtype (swiglu_packed on [gate | up])"},
    saved={"gate": "[tokens, ffn] dtype", "up": "[tokens, ffn] dtype", "x_packed": "[tokens, 2 * ffn] dtype"},
    dtypes=(torch.bfloat16, torch.float16),
    shapes={
        "small": ({"tokens": 16, "ffn": 384}, {"tokens": 7, "ffn": 1100}),
        "full": ({"tokens": 4096, "ffn": 8192}, {"tokens": 8192, "ffn": 14336}),
    },
    cost=_cost,
    differentiable=("gate", "up", "x_packed"),
    grad_outputs=("y", "y_packed"),
)
