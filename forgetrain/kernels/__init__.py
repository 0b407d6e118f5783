"""The kernel forge: fused Triton kernels, each beside the torch op it replaces and an fp64 oracle.

Functional APIs (stable; forged engines switch them per op, e.g. ``kernels.rmsnorm=triton|torch``):

* ``rmsnorm_residual(x [..., H], residual [..., H] | None, weight [H], eps) -> (y [..., H], s [..., H])``
  -- ``s = x + residual``, ``y = rms_norm(s) * weight``; bf16/fp16/fp32 (:mod:`.rmsnorm`).
* ``swiglu(gate [..., F], up [..., F]) -> [..., F]`` -- ``silu(gate) * up``; ``swiglu_packed(x [..., 2F]) -> [..., F]``
  the same on the fused ``[gate | up]``, its backward writing ``dx`` whole (:mod:`.swiglu`).
* ``apply_rope(t [B, S, H, D], cos [S, D] fp32, sin [S, D] fp32) -> [B, S, H, D]`` -- rotate-half RoPE;
  ``rope_tables(seq_len, head_dim, base)`` builds the tables (:mod:`.rope`).
* ``fused_linear_cross_entropy(hidden [N, h], weight [V, h], labels [N] int64, chunk_size=2048,
  ignore_index=-100) -> loss [N] fp32`` -- LM head + per-token CE without [N, V] logits (:mod:`.cross_entropy`).
* ``ce_chunk(logits [n, V], labels [n] int64, inv_n) -> (loss [n] fp32, dlogits [n, V])`` -- one chunk's
  cross-entropy and ``(softmax - onehot) * inv_n`` in two passes over the logits, for the chunked LM head
  (``kernels.ce_chunk=triton`` with ``kernels.cross_entropy=chunked``; no autograd) (:mod:`.ce_chunk`).
* ``adamw_step(params, grads, exp_avgs, exp_avg_sqs, main_params=None, *, step, lr, beta1, beta2, eps, wd)``
  -- multi-tensor AdamW, fp32 main weights copied back to the model dtype (:mod:`.adamw`).

``select(op, "triton" | "torch")`` returns either implementation; :mod:`.torch_ops` holds the torch ones (the
replaced ops, same signatures, importable without Triton).

Every kernel has a :class:`~forgetrain.kernels.spec.KernelSpec` (``get_spec(name)``, ``all_specs()``) that
:func:`~forgetrain.kernels.validate.validate`, :func:`~forgetrain.kernels.bench.bench` and
:func:`~forgetrain.kernels.seal.seal` consume; ``python -m forgetrain.kernels list|validate|bench|seal``.

Importing this package does not import Triton; the first use of a kernel or spec does. Without a CUDA device,
Triton runs in its CPU interpreter (``TRITON_INTERPRET=1`` is set before Triton is imported, see ``_triton``).
Note: the package attribute ``swiglu`` is the function; reach kernel *modules* with ``importlib`` or
``module_of(name)``.
"""

from __future__ import annotations

import importlib

from forgetrain.kernels import switches as _switches

# the kernels and their public functions, from the switch declarations (forgetrain/kernels/switches.py)
KERNELS = _switches.kernels()
_API = {api: s.kernel for s in _switches.SWITCHES if s.kernel for api in s.api}
_OP = {s.kernel: s.api[0] for s in _switches.SWITCHES if s.kernel}
__all__ = ["KERNELS", "get_spec", "all_specs", "module_of", "select", *_API]


def select(op: str, backend: str = "triton"):
    """The implementation of kernel ``op`` for ``backend``: "triton" (the forged kernel) or "torch" (the replaced
    op, :mod:`forgetrain.kernels.torch_ops`, same signature). Raises ForgeTrainError for unknown names."""
    from forgetrain.errors import ForgeTrainError
    if op not in _OP:
        raise ForgeTrainError(f"unknown kernel '{op}'; known: {', '.join(KERNELS)}")
    if backend == "torch":
        from forgetrain.kernels import torch_ops
        return getattr(torch_ops, _OP[op])
    if backend == "triton":
        module_of(op)
        return globals()[_OP[op]]
    raise ForgeTrainError(f"unknown kernel backend '{backend}'; use 'triton' or 'torch'")


def _pin(modname: str) -> None:
    """Importing submodule ``swiglu`` rebinds the package attribute to the module; put the function back."""
    mod = importlib.import_module(f"{__name__}.{modname}")
    for api, m in _API.items():
        if m == modname:
            globals()[api] = getattr(mod, api)


def module_of(name: str):
    """The module of kernel ``name``. Raises ForgeTrainError for an unknown name."""
    if name not in KERNELS:
        from forgetrain.errors import ForgeTrainError
        raise ForgeTrainError(f"unknown kernel '{name}'; known: {', '.join(KERNELS)}")
    mod = importlib.import_module(f"{__name__}.{name}")
    _pin(name)
    return mod


def get_spec(name: str):
    """The KernelSpec of kernel ``name``. Raises ForgeTrainError for an unknown name."""
    return module_of(name).SPEC


def all_specs() -> dict:
    """``{name: KernelSpec}`` for every kernel, in a fixed order."""
    return {n: get_spec(n) for n in KERNELS}


def __getattr__(name: str):
    if name in _API:
        module_of(_API[name])
        return globals()[name]
    if name == "SPECS":
        return all_specs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
