"""The replaced ops in plain PyTorch, with the same signatures as the Triton kernels (no Triton import).

These are what an eager engine runs, and what validation and benchmarks compare each kernel against (the specs'
``reference`` calls them). Forged engines switch per op between the two backends, e.g.
``forgetrain.kernels.select("rmsnorm", "torch")`` vs ``select("rmsnorm", "triton")``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.optim.adamw import adamw as _torch_adamw

__all__ = ["rmsnorm_residual", "swiglu", "apply_rope", "rotate_half", "fused_linear_cross_entropy", "ce_chunk",
           "adamw_step"]


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (or ``x``), ``y = F.rms_norm(s, (H,), weight, eps)``; returns ``(y, s)``."""
    s = x + residual if residual is not None else x
    return F.rms_norm(s, (s.shape[-1],), weight, eps), s


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``."""
    return F.silu(gate) * up


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(t * cos + rotate_half(t) * sin).to(t.dtype)`` for ``t`` ``[B, S, H, D]``, fp32 ``cos``/``sin`` ``[>=S, D]``
    (the product promotes to fp32; the cast back is what an engine must do before attention)."""
    S = t.shape[1]
    c = cos[:S][None, :, None, :]
    s = sin[:S][None, :, None, :]
    return (t * c + rotate_half(t) * s).to(t.dtype)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none")``: fp32 ``[N]``.
    ``chunk_size`` is accepted for signature compatibility and ignored (the full logits exist here)."""
    del chunk_size
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none", ignore_index=ignore_index)


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, inv_n: float,
             block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of Megatron-form cross-entropy, as the fast Hopper engine runs it (compiled by inductor on CUDA;
    ``scenarios/llama1b_h200/fast.py`` calls this function): logits ``[n, V]`` (bf16/fp32), labels ``[n]`` int64
    (all valid, no ignore_index) -> (loss ``[n]`` fp32, dlogits ``[n, V]`` in the logits' dtype =
    ``(softmax - onehot) * inv_n``), in fp32 with the max-shifted log-sum-exp (Blanchard, Higham & Higham 2021).
    ``block`` (the Triton kernel's tile width) is accepted for signature compatibility and ignored."""
    del block
    z = logits.float()
    zmax = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - zmax)
    sumexp = e.sum(dim=-1, keepdim=True)
    target = torch.gather(z, 1, labels[:, None])
    loss = (torch.log(sumexp) + zmax - target).squeeze(1)
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]
    g = (e / sumexp - onehot.to(z.dtype)) * inv_n
    return loss, g.to(logits.dtype)


def adamw_step(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, main_params: list | None = None,
               *, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               wd: float = 0.0) -> None:
    """``torch.optim.AdamW(foreach=False)``'s step (its functional form) on ``main_params`` (fp32) or, without
    them, on ``params`` themselves; then ``params[i].copy_(main_params[i])``. Grads are cast to the dtype of the
    updated tensors. ``step`` is 1-based (torch's state step after its increment)."""
    targets = main_params if main_params is not None else params
    gs = [g.to(t.dtype) for g, t in zip(grads, targets)]
    steps = [torch.tensor(float(step - 1)) for _ in targets]
    _torch_adamw(targets, gs, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
                 differentiable=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                 weight_decay=wd, eps=eps, maximize=False)
    if main_params is not None:
        for p, w in zip(params, main_params):
            p.copy_(w)
