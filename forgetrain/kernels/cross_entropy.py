"""LM-head matmul fused with per-token cross-entropy, chunked so the ``[tokens, vocab]`` logits never exist.

Replaces ``F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none")``.

Math (softmax cross-entropy; max-subtracted log-sum-exp, e.g. Blanchard, Higham & Higham 2021, "Accurately
computing the log-sum-exp and softmax functions"):

    z_v     = <hidden_n, weight_v>                          fp32 accumulation of bf16 products
    lse_n   = m_n + log(sum_v exp(z_v - m_n)),  m_n = max_v z_v
    loss_n  = lse_n - z_{label_n}        (0 where label_n == ignore_index)
    dz_nv   = dloss_n * (exp(z_nv - lse_n) - [v == label_n])   (0 for ignored tokens), rounded to hidden.dtype
    dhidden = dz @ weight        dweight = dz^T @ hidden

Chunking: ``chunk_size`` is a memory budget counted in tokens: the transient fp32 logits block holds
``chunk_size * V`` elements, laid out as a *vocab slice* of all N tokens, ``[N, Vc]`` with
``Vc = ceil(chunk_size * V / N)`` (:func:`vocab_slices`). The ``[N, V]`` logits never exist. Slicing the
vocabulary rather than the tokens keeps two properties a token chunking would lose: ``dweight[slice]`` is one
matmul over all tokens (fp32 accumulation, one rounding, as in the eager op), and forward and backward issue the
same matmul calls, so the recomputed logits are bitwise those of the forward and ``softmax - onehot`` of a
confident token is ~0 rather than ~1 ulp of its logit.

Forward: per slice, the fp32 logits ``[N, Vc]`` come from one matmul (bf16 inputs, fp32 output:
``torch.mm(..., out_dtype=float32)`` on CUDA) and a Triton kernel folds the slice into each row's running max
and sum-exp (online log-sum-exp) and picks the label's logit. Only ``lse`` (fp32 ``[N]``) is saved.

Backward: per slice, the logits are recomputed, a Triton kernel writes ``dz`` (bf16), ``dweight[slice] =
dz^T @ hidden``, and ``dhidden += dz @ weight[slice]`` accumulates in fp32 (rounded once at the end). Cost: one
extra logits matmul in backward (4 matmuls instead of 3) in exchange for never holding the ``[N, V]`` logits
(eager holds bf16 logits, their fp32 copy and the fp32 gradient: 10 bytes per logit).

The matmuls are cuBLAS (torch.mm); the Triton kernels are the softmax / loss / gradient passes over each chunk.
The logits stay fp32 (the replaced op rounds them to bf16 first), so the loss is more accurate than eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["fused_linear_cross_entropy", "make_fused_linear_cross_entropy", "SPEC"]


@triton.jit
def _ce_fwd_kernel(LOGITS, LABELS, M, S, ZL, stride_l, v_start, VC, ignore_index,
                   FIRST: tl.constexpr, BLOCK_V: tl.constexpr):
    """One vocab slice [v_start, v_start + VC) of every row: fold the slice's max / sum-exp into the running
    (M, S) of the row (online log-sum-exp) and pick the label's logit when it falls in the slice."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    cols = tl.arange(0, BLOCK_V)
    z = tl.load(base + cols, mask=cols < VC, other=float("-inf"))
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - m), axis=0)
    for v0 in range(BLOCK_V, VC, BLOCK_V):
        z = tl.load(base + v0 + cols, mask=(v0 + cols) < VC, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    if not FIRST:
        m_prev = tl.load(M + row)
        s_prev = tl.load(S + row)
        m_new = tl.maximum(m_prev, m)
        s = s_prev * tl.exp(m_prev - m_new) + s * tl.exp(m - m_new)
        m = m_new
    tl.store(M + row, m)
    tl.store(S + row, s)
    label = tl.load(LABELS + row)
    in_slice = (label != ignore_index) & (label >= v_start) & (label < v_start + VC)
    z_label = tl.load(base + (label - v_start), mask=in_slice, other=0.0)
    if FIRST:
        tl.store(ZL + row, z_label)
    else:
        tl.store(ZL + row, z_label, mask=in_slice)


@triton.jit
def _ce_bwd_kernel(LOGITS, LSE, LABELS, DLOSS, DZ, stride_l, stride_dz, stride_dloss, v_start, VC, ignore_index,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < VC
    z = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=0.0)
    lse = tl.load(LSE + row)
    label = tl.load(LABELS + row)
    g = tl.load(DLOSS + row * stride_dloss)
    g = tl.where(label != ignore_index, g, 0.0)
    p = tl.exp(z - lse)
    p = tl.where((cols + v_start) == label, p - 1.0, p)
    tl.store(DZ + row * stride_dz + cols, (p * g).to(DZ.dtype.element_ty), mask=mask)


_MM_OUT_DTYPE_OK: dict = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 output and fp32 accumulation of the (bf16/fp16) products.

    CUDA: ``torch.mm(a, b, out_dtype=torch.float32)`` (cuBLAS, tensor cores); if this torch lacks it, falls back
    to an fp32 matmul of upcast copies (same numbers, much slower; a warning is printed once). CPU: fp32 matmul
    of the upcast (exact) copies.
    """
    if a.dtype == torch.float32:
        return a @ b.float()
    if a.is_cuda:
        key = (a.device, a.dtype)
        if _MM_OUT_DTYPE_OK.get(key, True):
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError) as e:
                _MM_OUT_DTYPE_OK[key] = False
                print(f"forgetrain.kernels.cross_entropy: torch.mm(out_dtype=float32) unavailable ({e}); "
                      f"using a slow fp32 matmul")
    return a.float() @ b.float()


def vocab_slices(N: int, V: int, chunk_size: int) -> list[tuple[int, int]]:
    """The vocab slices ``[(v0, v1), ...]`` both passes use: each holds ``~chunk_size * V`` logits of all ``N``
    tokens (width rounded up to a multiple of 128). Forward and backward must issue identical matmuls so the
    recomputed logits are bitwise the forward's (else ``softmax - onehot`` of a confident token is ~1 ulp of
    its logit instead of ~0)."""
    vc = max(1, -(-chunk_size * V // max(N, 1)))
    vc = min(V, ((vc + 127) // 128) * 128)
    return [(v0, min(V, v0 + vc)) for v0 in range(0, V, vc)]


def make_fused_linear_cross_entropy(fwd_kernel=_ce_fwd_kernel, bwd_kernel=_ce_bwd_kernel):
    """Build the functional API around a (forward, backward) kernel pair (tests inject broken variants)."""

    class _FusedLinearCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels, chunk_size, ignore_index):
            N, _ = hidden.shape
            V = weight.shape[0]
            m = empty((N,), torch.float32, hidden.device)
            s = empty((N,), torch.float32, hidden.device)
            z_label = empty((N,), torch.float32, hidden.device)
            for i, (v0, v1) in enumerate(vocab_slices(N, V, chunk_size)):
                logits = _mm_f32(hidden, weight[v0:v1].t())
                if N > 0:
                    fwd_kernel[(N,)](logits, labels, m, s, z_label, logits.stride(0), v0, v1 - v0, ignore_index,
                                     FIRST=i == 0, BLOCK_V=min(4096, next_pow2(v1 - v0)), num_warps=8)
                del logits
            lse = m + torch.log(s)
            loss = torch.where(labels != ignore_index, lse - z_label, 0.0)
            ctx.save_for_backward(hidden, weight, labels, lse)
            ctx.chunk_size = chunk_size
            ctx.ignore_index = ignore_index
            return loss

        @staticmethod
        def backward(ctx, dloss):
            hidden, weight, labels, lse = ctx.saved_tensors
            N, H = hidden.shape
            V = weight.shape[0]
            need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            if N == 0:
                return (torch.zeros_like(hidden) if need_dh else None,
                        torch.zeros_like(weight) if need_dw else None, None, None, None)
            dh32 = torch.zeros((N, H), dtype=torch.float32, device=hidden.device) if need_dh else None
            dw = empty((V, H), weight.dtype, weight.device) if need_dw else None
            for v0, v1 in vocab_slices(N, V, ctx.chunk_size):
                w_s = weight[v0:v1]
                logits = _mm_f32(hidden, w_s.t())
                BLOCK = min(2048, next_pow2(v1 - v0))
                dz = empty((N, v1 - v0), hidden.dtype, hidden.device)
                bwd_kernel[(N, triton.cdiv(v1 - v0, BLOCK))](logits, lse, labels, dloss, dz, logits.stride(0),
                                                             dz.stride(0), dloss.stride(0), v0, v1 - v0,
                                                             ctx.ignore_index, BLOCK=BLOCK, num_warps=8)
                del logits
                if need_dw:
                    if dz.is_cuda:
                        torch.mm(dz.t(), hidden, out=dw[v0:v1])
                    else:
                        dw[v0:v1].copy_(_mm_f32(dz.t(), hidden))
                if need_dh:
                    dh32 += _mm_f32(dz, w_s)
                del dz
            dh = None
            if need_dh:
                dh = empty((N, H), hidden.dtype, hidden.device)
                dh.copy_(dh32)
            return dh, dw, None, None, None

    def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
        """Per-token ``cross_entropy(hidden @ weight.T, labels)`` without materialising the logits.

        Args:
            hidden: ``[N, h]`` final hidden states (bf16 / fp16 / fp32), N = tokens.
            weight: ``[V, h]`` LM-head / output embedding, same dtype as ``hidden``.
            labels: ``[N]`` int64 targets in ``[0, V)`` or ``ignore_index`` (not range-checked on the device).
            chunk_size: memory budget in tokens: transient memory is ~``chunk_size * V * 4`` bytes (fp32 logits,
                as vocab slices of all tokens) in forward and about 1.5x that in backward.
            ignore_index: label value whose token gets loss 0 and no gradient (as in F.cross_entropy).
        Returns:
            ``[N]`` fp32 per-token loss (reduce it yourself; gradients flow through any reduction).
        Saved for backward: ``hidden``, ``weight``, ``labels``, ``lse`` (fp32 ``[N]``).
        Raises:
            ValueError: shape/dtype mismatch, chunk_size < 1, or unsupported device.
        """
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"hidden [N, h] and weight [V, h] expected, got {tuple(hidden.shape)} and "
                             f"{tuple(weight.shape)}")
        if labels.shape != (hidden.shape[0],) or labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"labels must be int64 [{hidden.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
        if hidden.dtype != weight.dtype or not hidden.is_floating_point():
            raise ValueError(f"hidden and weight must share one float dtype, got {hidden.dtype}/{weight.dtype}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_device(hidden, weight, labels)
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        if weight.stride(-1) != 1:
            weight = weight.contiguous()
        return _FusedLinearCE.apply(hidden, weight, labels.contiguous(), int(chunk_size), int(ignore_index))

    return fused_linear_cross_entropy


fused_linear_cross_entropy = make_fused_linear_cross_entropy()


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    return lambda inp: {"loss": fn(inp["hidden"], inp["weight"], inp["labels"], inp["chunk_size"])}


def _reference(inp):
    return {"loss": torch_ops.fused_linear_cross_entropy(inp["hidden"], inp["weight"], inp["labels"])}


def _oracle(inp):
    logits = F.linear(inp["hidden"], inp["weight"])
    return {"loss": F.cross_entropy(logits, inp["labels"], reduction="none")}


def _make_inputs(shape, dtype, device, gen):
    """Logits ~ N(0, logit_std^2) per entry; logit_std 60 puts the max logit of a row near 200, beyond where
    fp32 exp overflows (~88.7), so an LSE without max-subtraction returns inf. 10% of labels are ignore_index."""
    N, H, V = shape["tokens"], shape["hidden"], shape["vocab"]
    std = float(shape.get("logit_std", 2.0))
    hidden = torch.randn(N, H, generator=gen, device=device) * std
    weight = torch.randn(V, H, generator=gen, device=device) / H ** 0.5
    labels = torch.randint(0, V, (N,), generator=gen, device=device)
    drop = torch.rand(N, generator=gen, device=device) < 0.1
    labels = torch.where(drop, torch.full_like(labels, -100), labels)
    return {"hidden": hidden.to(dtype), "weight": weight.to(dtype), "labels": labels,
            "chunk_size": int(shape["chunk"])}


def _cost(shape, dtype):
    N, H, V = shape["tokens"], shape["hidden"], shape["vocab"]
    b = torch.tensor([], dtype=dtype).element_size()
    # Useful work of the replaced op (logits matmul fwd; two gradient matmuls bwd); recompute is not credited.
    return {"fwd": {"bytes": (N * H + V * H) * b + 12 * N, "flops": 2 * N * V * H},
            "bwd": {"bytes": 2 * (N * H + V * H) * b + 12 * N, "flops": 4 * N * V * H}}


SPEC = KernelSpec(
    name="cross_entropy",
    module=__name__,
    api="fused_linear_cross_entropy(hidden [N, h], weight [V, h], labels [N] int64, chunk_size=2048, "
        "ignore_index=-100) -> loss [N] fp32",
    replaces="F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction='none')",
    candidate=candidate_from(fused_linear_cross_entropy),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"hidden": "[tokens, hidden] dtype", "weight": "[vocab, hidden] dtype",
            "labels": "[tokens] int64 (10% ignore_index=-100)", "chunk_size": "int"},
    outputs={"loss": "[tokens] fp32"},
    saved={"hidden": "[tokens, hidden]", "weight": "[vocab, hidden]", "labels": "[tokens] int64",
           "lse": "[tokens] fp32"},
    dtypes=(torch.bfloat16,),
    shapes={
        "small": ({"tokens": 40, "hidden": 64, "vocab": 600, "chunk": 16},
                  {"tokens": 24, "hidden": 48, "vocab": 300, "chunk": 10, "logit_std": 60.0}),
        "full": ({"tokens": 4096, "hidden": 2048, "vocab": 128256, "chunk": 2048},
                 {"tokens": 8192, "hidden": 4096, "vocab": 128256, "chunk": 2048},
                 {"tokens": 4096, "hidden": 4096, "vocab": 128256, "chunk": 2048, "logit_std": 60.0}),
        "bench": ({"tokens": 4096, "hidden": 2048, "vocab": 128256, "chunk": 2048},
                  {"tokens": 8192, "hidden": 4096, "vocab": 128256, "chunk": 2048}),
    },
    cost=_cost,
    differentiable=("hidden", "weight"),
    grad_outputs=("loss",),
    bound="compute",
)
