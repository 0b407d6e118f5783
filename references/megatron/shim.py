"""A small CPU device shim that lets megatron-core 0.16.1 run on a machine without a GPU.

megatron-core assumes CUDA in a handful of *device-placement* spots: it allocates scalars and grad buffers with
``device='cuda'`` or ``device=torch.cuda.current_device()``, moves tensors with ``Tensor.cuda()``, asserts that
gradients report ``Tensor.type() == 'torch.cuda.FloatTensor'`` before clipping (and dispatches on the same string
when it builds the bf16 main weights), and keeps its dropout RNG states in a CUDA ``RNGStatesTracker``. On a
CPU-only machine every one of these calls raises. This module maps them to the CPU and nothing else.

Rules
-----
* :func:`install` is called only when the reference runs on ``device='cpu'``. It is idempotent and process-wide,
  but every patch is **scoped to callers whose module name starts with ``megatron.``** (checked on the calling
  frame), so torch itself, the harness, the tests and any forged engine in the same process see unmodified torch.
* No patch touches a value: each either changes *where* a tensor is allocated (CUDA -> CPU), returns a type
  *name* string, or swaps which generator state is current inside a ``fork()``. Megatron's arithmetic (its
  kernels, its optimizer, its clipping, its norm) runs unmodified; the reference code is never edited.
* :func:`uninstall` restores the originals (used by tests; engines never need it).

The patches, and why each is arithmetic-neutral
-----------------------------------------------
1. ``torch.tensor / zeros / ones / empty / full`` with a CUDA ``device=`` argument -> ``device='cpu'``. These are
   the optimizer's scalar buffers (``_scale``, ``_scale_one``, ``found_inf``, ``_dummy_overflow_buf``), the
   grad-norm scalar (``local_multi_tensor_l2_norm``'s ``l2_cuda``, ``clip_grads``'s ``grad_norm`` /
   ``dummy_overflow_buf`` / ``total_num_zeros``) and the schedule's ``total_num_tokens``. Same dtype, same value,
   only the device differs; every consumer is a CPU tensor op that would have run on CPU anyway.
2. ``torch.cuda.current_device()`` -> ``torch.device('cpu')``. Used only as a ``device=`` / ``.to()`` argument
   (grad buffers in ``param_and_grad_buffer``, RoPE ``inv_freq``, attention scratch). Allocation only.
3. ``torch.cuda.manual_seed(seed)`` -> no-op. In ``model_parallel_cuda_manual_seed`` it seeds the *device* default
   generator. On CPU the device generator is the CPU generator, which the engine has already seeded with the
   same seed (``torch.manual_seed(seed)`` is called first, exactly as Megatron-LM's ``_set_random_seed`` does),
   and nothing consumes random numbers in between, so re-seeding would leave the state identical.
4. ``Tensor.cuda()`` -> returns the tensor itself (what ``.to('cpu')`` returns for a CPU tensor). Placement only.
5. ``Tensor.type()`` *with no argument* on a CPU tensor -> the CUDA type name (``'torch.FloatTensor'`` ->
   ``'torch.cuda.FloatTensor'``, same for BFloat16/Half). Megatron only compares these strings: the assertion in
   ``clip_grad_by_total_norm_fp32`` and the fp16/bf16-vs-fp32 dispatch in ``Float16OptimizerWithFloat16Params``.
   The dtype part of the name is untouched, so the dispatch picks exactly the branch it picks on GPU.
   ``Tensor.type(dtype)`` (a cast) is never touched.
6. The RNG tracker (``tensor_parallel.random._CUDA_RNG_STATE_TRACKER``) is replaced by :class:`CpuRNGStatesTracker`,
   which keeps named *CPU* generator states and swaps the CPU generator in ``fork()`` exactly as the CUDA tracker
   swaps the CUDA generator. Megatron forks it around attention dropout; with ``attention_dropout=0`` the dropout
   is the identity (``F.dropout`` with ``p=0`` returns its input without drawing random numbers), so the swap
   cannot change any value, and the CPU generator is restored on exit.

Not shimmed (not needed with the settings the reference uses): CUDA streams (``overlap_grad_reduce=False``),
``torch.cuda.synchronize`` (not reached with gloo), the TE/Apex fused kernels (not installed; Megatron itself
falls back to torch's ``AdamW`` and its local ``multi_tensor_*`` helpers).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

_LOCK = threading.Lock()
_INSTALLED = False
_ORIGINALS: dict[str, object] = {}
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _called_from_megatron(depth: int = 2) -> bool:
    """True when the frame ``depth`` levels up (the caller of the patched function) is megatron code."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return False
    return str(frame.f_globals.get("__name__", "")).startswith("megatron.")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False  # an int index means "cuda:<i>" only inside megatron; it never passes one on the paths we run


def _wrap_factory(orig):
    @functools.wraps(orig)
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")) and _called_from_megatron():
            kwargs["device"] = "cpu"
        return orig(*args, **kwargs)

    return factory


def _current_device(orig):
    @functools.wraps(orig)
    def current_device():
        if _called_from_megatron():
            return torch.device("cpu")
        return orig()

    return current_device


def _manual_seed(orig):
    @functools.wraps(orig)
    def manual_seed(seed):
        if _called_from_megatron():
            return None
        return orig(seed)

    return manual_seed


def _tensor_cuda(orig):
    @functools.wraps(orig)
    def cuda(self, *args, **kwargs):
        if self.device.type == "cpu" and _called_from_megatron():
            return self
        return orig(self, *args, **kwargs)

    return cuda


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        name = orig(self, *args, **kwargs)
        if (not args and not kwargs and isinstance(name, str) and self.device.type == "cpu"
                and name.startswith("torch.") and not name.startswith("torch.cuda.")
                and _called_from_megatron()):
            return "torch.cuda." + name[len("torch."):]
        return name

    return type_


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` with the CPU generator standing in for the CUDA one.

    Same interface (``reset``, ``get_states``, ``set_states``, ``add``, ``fork``, ``is_initialized``) and the same
    semantics: ``add(name, seed)`` records the generator state obtained by seeding with ``seed`` and restores the
    current state; ``fork(name)`` makes that state current for the duration of the block, saves the advanced state
    back under ``name`` and restores the outer state.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current rng state {self._current_state_name} is not {name}")
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name


def install_rng_tracker() -> None:
    """Make megatron's global RNG tracker a :class:`CpuRNGStatesTracker` (keeps an existing CPU tracker)."""
    from megatron.core.tensor_parallel import random as mrandom

    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _warm_device_constructors() -> None:
    """Fill torch's cached set of factory functions (``torch.utils._device._device_constructors``, read by the
    ``with torch.device(...)`` context manager) with the builtin factories before they are wrapped. The set is built
    on first use; built after :func:`install` it would hold the wrappers instead, so ``with torch.device("meta")``
    would stop applying to ``torch.empty`` / ``zeros`` / ``ones`` / ``full`` / ``tensor`` everywhere in the process
    (seen as an HF model built "on meta" landing on the CPU after a Megatron CPU step). A private torch helper:
    when it is absent there is no such cache to protect."""
    try:
        from torch.utils._device import _device_constructors
    except ImportError:
        return
    _device_constructors()


def install() -> None:
    """Install every patch (idempotent). Call only for CPU runs of the reference."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            _warm_device_constructors()
            for name in _FACTORIES:
                orig = getattr(torch, name)
                _ORIGINALS["torch." + name] = orig
                setattr(torch, name, _wrap_factory(orig))
            _ORIGINALS["torch.cuda.current_device"] = torch.cuda.current_device
            torch.cuda.current_device = _current_device(torch.cuda.current_device)
            _ORIGINALS["torch.cuda.manual_seed"] = torch.cuda.manual_seed
            torch.cuda.manual_seed = _manual_seed(torch.cuda.manual_seed)
            _ORIGINALS["Tensor.cuda"] = torch.Tensor.cuda
            torch.Tensor.cuda = _tensor_cuda(torch.Tensor.cuda)
            _ORIGINALS["Tensor.type"] = torch.Tensor.type
            torch.Tensor.type = _tensor_type(torch.Tensor.type)
            _INSTALLED = True
    install_rng_tracker()


def uninstall() -> None:
    """Restore the original torch functions (the RNG tracker is reset to megatron's lazy default)."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            return
        for name in _FACTORIES:
            setattr(torch, name, _ORIGINALS.pop("torch." + name))
        torch.cuda.current_device = _ORIGINALS.pop("torch.cuda.current_device")
        torch.cuda.manual_seed = _ORIGINALS.pop("torch.cuda.manual_seed")
        torch.Tensor.cuda = _ORIGINALS.pop("Tensor.cuda")
        torch.Tensor.type = _ORIGINALS.pop("Tensor.type")
        _INSTALLED = False
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def installed() -> bool:
    return _INSTALLED
