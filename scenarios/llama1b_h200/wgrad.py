"""Gradient accumulation fusion for the fast Hopper engine (``engine.grad_accum_fusion=true``).

Without it, every micro-batch's backward materialises a ``.grad`` per weight in the weight's dtype (bf16), which
``Engine.train_step`` then copies (first micro-batch) or adds (the others) into the fp32 ``main_grad`` buffer.
With it, the weight-gradient GEMM of every linear layer (``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``,
the LM head) writes its fp32 result straight into ``main_grad`` -- on the first micro-batch by overwriting
(GEMM beta = 0), afterwards by accumulating (beta = 1) -- and the embedding's gradient is scattered into
``main_grad`` with ``index_add_`` in fp32. No bf16 ``.grad`` and no separate add pass exist for those weights;
only the 1-D norm weights keep the autograd ``.grad`` path. Megatron-core calls this
``gradient_accumulation_fusion`` (its ``wgrad_gemm_accum_fp32`` kernel); the arithmetic meaning is kept:
``main_grad = sum over micro-batches of the gradient of loss / n``. The difference from the unfused path is that
each micro-batch's weight gradient is not rounded to bf16 before the fp32 sum, so the engine declares the
**tolerance** tier for it (``optimisations.yaml``: ``grad_accum_fusion``).

Why overwrite on the first micro-batch instead of zeroing ``main_grad`` once per step: zeroing is one more
write pass over the whole fp32 buffer (7.6 GB for the 8B proxy's 1.9 B parameters, about 2 ms at HBM speed),
while beta = 0 costs nothing (cuBLAS does not read C then, so stale values, even NaN, cannot leak in). Every
fused weight is used exactly once per micro-batch, so "first contribution of the step" is "first micro-batch";
the LM head's chunked cross-entropy overwrites with its first chunk only.

The GEMM path on CUDA with bf16 inputs is chosen once per process by :func:`probe_path` from :data:`PATHS`,
the first that runs and gives the fp64 answer: (1) ``torch.addmm(.., out_dtype=float32, out=main_grad)``, one
cuBLAS call with fp32 output and beta in place; (2) ``torch.mm(.., out_dtype=float32)`` then one fp32 add;
(3) fp32 upcast of both operands and ``main_grad.addmm_``. On CPU (no ``out_dtype`` kernels) it is (3); with fp32
inputs every path is one ``main_grad.addmm_``.

Shapes: ``dy [..., out]`` and ``x [..., in]`` (the leading dims are flattened to tokens), ``main_grad [out, in]``
fp32, contiguous (a view of the DP flat buffer is fine).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PATHS = ("addmm_out_dtype", "mm_out_dtype", "fp32_upcast")  # probe order: the first that works is used


@dataclass(frozen=True)
class WGradAccum:
    """One micro-batch's accumulation order, passed by ``train_step`` to ``FastLlama.forward``.

    first: this is the step's first micro-batch (the GEMMs overwrite ``main_grad``: beta = 0).
    scale: the factor the loss is backpropagated with (``1 / n`` for ``(loss / n).backward()``); only the LM
        head's chunked cross-entropy needs it, because it computes dW in its forward, before ``dloss`` exists.
    path: one of :data:`PATHS` (from :func:`probe_path`).
    """

    first: bool
    scale: float
    path: str


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def gemm_accumulate(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool, alpha: float,
                    path: str) -> None:
    """``main_grad = [0 if overwrite else main_grad] + alpha * dy^T @ x`` in fp32, in place, by ``path``.

    ``dy [..., out]``, ``x [..., in]`` (same dtype), ``main_grad [out, in]`` fp32. Raises ValueError for an
    unknown path; whatever torch raises when the path's kernel does not exist on this device."""
    if path not in PATHS:
        raise ValueError(f"unknown gradient-accumulation path '{path}'; known: {', '.join(PATHS)}")
    a, b = _flat(dy).t(), _flat(x)
    beta = 0.0 if overwrite else 1.0
    if a.dtype == torch.float32:
        main_grad.addmm_(a, b, beta=beta, alpha=alpha)
    elif path == "addmm_out_dtype":
        torch.addmm(main_grad, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=main_grad)
    elif path == "mm_out_dtype":
        part = torch.mm(a, b, out_dtype=torch.float32)
        if overwrite:
            torch.mul(part, alpha, out=main_grad)
        else:
            main_grad.add_(part, alpha=alpha)
    else:  # fp32_upcast
        main_grad.addmm_(a.float(), b.float(), beta=beta, alpha=alpha)


@torch.library.custom_op("forgetrain::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool, alpha: float,
                     path: str) -> None:
    """:func:`gemm_accumulate` as an opaque op that mutates ``main_grad``, so ``torch.compile`` (the per-block
    compile of ``engine.compile=true``) keeps it as one call in the backward graph instead of tracing into it."""
    gemm_accumulate(main_grad, dy, x, overwrite, alpha, path)


@wgrad_accumulate.register_fake
def _(main_grad, dy, x, overwrite, alpha, path) -> None:
    return None


class LinearMainGrad(torch.autograd.Function):
    """``y = x @ w^T`` (``F.linear``) whose backward returns ``dx = dy @ w`` and, instead of ``dw``, accumulates
    ``dy^T @ x`` into ``main_grad`` (fp32, ``[out, in]``) through :func:`wgrad_accumulate`; ``w.grad`` stays None.

    ``main_grad`` rides on ``ctx`` (not ``save_for_backward``): it is written between forward and backward (other
    weights' views of the same DP flat buffer share its version counter), which is intended."""

    @staticmethod
    def forward(ctx, x, w, main_grad, overwrite: bool, path: str):
        ctx.save_for_backward(x, w)
        ctx.main_grad, ctx.overwrite, ctx.path = main_grad, overwrite, path
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        wgrad_accumulate(ctx.main_grad, dy, x, ctx.overwrite, 1.0, ctx.path)
        return dy @ w, None, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor | None, acc: WGradAccum | None):
    """``F.linear(x, w)``; with ``acc`` (and a ``main_grad``) its weight gradient goes to ``main_grad``."""
    if acc is None or main_grad is None:
        return F.linear(x, w)
    return LinearMainGrad.apply(x, w, main_grad, acc.first, acc.path)


class EmbeddingMainGrad(torch.autograd.Function):
    """``F.embedding(ids, w)`` whose backward scatters ``dy`` (cast to fp32) into ``main_grad [V, h]`` with
    ``index_add_`` (zeroing it first on the step's first micro-batch); ``w.grad`` stays None. On CUDA under
    ``torch.use_deterministic_algorithms`` torch runs ``index_add_`` deterministically."""

    @staticmethod
    def forward(ctx, ids, w, main_grad, overwrite: bool):
        ctx.save_for_backward(ids)
        ctx.main_grad, ctx.overwrite = main_grad, overwrite
        return F.embedding(ids, w)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        if ctx.overwrite:
            ctx.main_grad.zero_()
        ctx.main_grad.index_add_(0, ids.reshape(-1), _flat(dy).float())
        return None, None, None, None


def embedding(ids: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor | None, acc: WGradAccum | None):
    """``F.embedding(ids, w)``; with ``acc`` (and a ``main_grad``) its gradient goes to ``main_grad``."""
    if acc is None or main_grad is None:
        return F.embedding(ids, w)
    return EmbeddingMainGrad.apply(ids, w, main_grad, acc.first)


def _probe_one(fn, device: torch.device) -> str | None:
    """None when ``fn(main_grad, dy, x, overwrite, alpha)`` runs on ``device`` with bf16 inputs and matches fp64:
    overwrite over NaN, then accumulate with alpha 0.5, into a view at an offset of a flat buffer (as under DP);
    else the one-line reason it was rejected."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dy = torch.randn(3, 40, 48, generator=g).to(device, torch.bfloat16)
    x = torch.randn(3, 40, 72, generator=g).to(device, torch.bfloat16)
    flat = torch.full((48 * 72 + 32,), float("nan"), device=device)
    mg = flat[32:].view(48, 72)
    want = 1.5 * (_flat(dy).double().t() @ _flat(x).double())
    try:
        fn(mg, dy, x, True, 1.0)
        fn(mg, dy, x, False, 0.5)
    except Exception as e:  # noqa: BLE001 - any failure rules the path out; the reason is recorded
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    err = float((mg.double() - want.to(device)).abs().max() / want.abs().max())
    if not err < 1e-5 or int(flat[:32].isnan().sum()) != 32:  # fp32 sums of exact bf16 products: ~1e-7
        return f"wrong result (max rel err {err:.2e}) or a write outside its view"
    return None


_CHOSEN: dict = {}


def probe_path(device: torch.device | str, candidates: dict | None = None) -> tuple[str, dict[str, str]]:
    """(chosen path, {rejected path: reason}) for bf16 inputs on ``device``: the first of ``candidates``
    (name -> ``fn(main_grad, dy, x, overwrite, alpha)``; default :data:`PATHS` through :func:`gemm_accumulate`
    on CUDA, only ``fp32_upcast`` on CPU, which has no ``out_dtype`` kernels) that runs and matches fp64
    (:func:`_probe_one`). The default probe runs once per device type, is cached and prints one line.
    Raises RuntimeError when no candidate works."""
    device = torch.device(device)
    default = candidates is None
    if default:
        if device.type in _CHOSEN:
            return _CHOSEN[device.type]
        names = PATHS if device.type == "cuda" else ("fp32_upcast",)
        candidates = {p: (lambda mg, dy, x, o, a, p=p: gemm_accumulate(mg, dy, x, o, a, p)) for p in names}
    rejected = {}
    for name, fn in candidates.items():
        why = _probe_one(fn, device)
        if why is None:
            if default:
                _CHOSEN[device.type] = (name, rejected)
                print(f"grad_accum_fusion: {device.type} path {name}" +
                      (f" (rejected: {rejected})" if rejected else ""), file=sys.stderr)
            return name, rejected
        rejected[name] = why
    raise RuntimeError(f"grad_accum_fusion: no gradient-accumulation path works on {device}: {rejected}")
