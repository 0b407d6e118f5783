"""One place that imports Triton for the kernel modules.

* When no CUDA device is present, ``TRITON_INTERPRET=1`` is set (if the caller has not set it) *before* Triton is
  imported, so every ``@triton.jit`` kernel runs in Triton's CPU interpreter on CPU tensors.
* When interpreting, :mod:`forgetrain.kernels._interp` fixes the interpreter's bf16 rounding (see there).
* :func:`empty` is the only allocator the kernels use for outputs and gradients. Inside :func:`poisoned` it
  fills the buffer with NaN (floating dtypes) or the dtype's minimum (integers), so validation catches elements
  that a kernel never writes.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
except ImportError as e:  # pragma: no cover - exercised only where triton is absent
    from forgetrain.extras import install_hint

    raise ImportError(f"forgetrain.kernels needs triton ({install_hint('kernels')}); the torch implementations "
                      f"need no triton: forgetrain.kernels.torch_ops") from e
HAVE_TRITON = True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


if HAVE_TRITON and interpreting():
    from forgetrain.kernels import _interp
    _interp.apply()

_POISON = False


@contextlib.contextmanager
def poisoned():
    """Within this context, :func:`empty` returns NaN-filled (or min-int-filled) buffers."""
    global _POISON
    prev, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = prev


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``; NaN / min-int filled when poisoning is on (validation)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        elif dtype != torch.bool:
            t.fill_(torch.iinfo(dtype).min)
    return t


def check_device(*tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that Triton can run on here."""
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cpu" and not interpreting():
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {dev}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
