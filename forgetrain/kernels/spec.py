"""KernelSpec: the contract of one forged kernel.

A spec names the op the kernel replaces (the torch code an eager engine would run), describes its inputs,
outputs and saved tensors, and carries four callables over an *inputs dict* (``name -> tensor | list[tensor] |
python scalar``):

* ``make_inputs(shape, dtype, device, generator) -> inputs``: fresh random inputs for one grid point.
* ``candidate(inputs) -> outputs``: runs the Triton kernel through its public functional API.
* ``reference(inputs) -> outputs``: runs the replaced torch op, in the same dtypes.
* ``oracle(inputs64) -> outputs``: the same math in float64 on float64 copies of the inputs (integers kept).

``outputs`` is a dict ``name -> tensor | list[tensor]``. Inputs named in ``differentiable`` get
``requires_grad``; the validator draws random upstream gradients for the outputs named in ``grad_outputs`` and
compares the gradient of every differentiable input, named ``"d" + input name``. ``derived(original_inputs,
outputs)`` may add float64 quantities to compare (e.g. the AdamW update ``p_new - p_old``), computed the same
way for all three sides.

``cost(shape, dtype) -> {"fwd": {"bytes", "flops"}, "bwd": {...}}`` gives the work a benchmark divides by time
(the minimum HBM traffic for memory-bound kernels, the matmul FLOPs of the replaced op for compute-bound ones);
``bound`` says which ceiling applies ("memory" or "compute"). ``shapes`` holds the grids "small" (CPU
interpreter), "full" (scenario shapes, validated on the GPU) and optionally "bench" (the subset of "full" worth
timing; defaults to "full").
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

Inputs = dict
Outputs = dict


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str
    replaces: str
    candidate: Callable[[Inputs], Outputs]
    reference: Callable[[Inputs], Outputs]
    oracle: Callable[[Inputs], Outputs]
    make_inputs: Callable[[dict, torch.dtype, torch.device, torch.Generator], Inputs]
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    saved: Mapping[str, str]
    dtypes: tuple
    shapes: Mapping[str, tuple]
    cost: Callable[[dict, torch.dtype], dict]
    differentiable: tuple = ()
    grad_outputs: tuple = ()
    bitwise: bool = False
    inplace: bool = False
    derived: Callable[[Inputs, Outputs], Outputs] | None = None
    bound: str = "memory"
    api: str = ""

    def grid(self, shapes: str) -> list:
        """The shape grid ``shapes`` ("small", "full" or "bench"; "bench" falls back to "full")."""
        if shapes == "bench" and "bench" not in self.shapes:
            shapes = "full"
        return [dict(s) for s in self.shapes[shapes]]

    def source_path(self) -> Path:
        """The file holding this kernel's source (hashed by the seal)."""
        mod = importlib.import_module(self.module)
        return Path(mod.__file__).resolve()

    def describe(self) -> dict:
        """JSON-able description of the contract (no callables)."""
        return {
            "name": self.name,
            "module": self.module,
            "api": self.api,
            "replaces": self.replaces,
            "inputs": dict(self.inputs),
            "outputs": dict(self.outputs),
            "saved": dict(self.saved),
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "differentiable": list(self.differentiable),
            "bitwise": self.bitwise,
            "inplace": self.inplace,
            "bound": self.bound,
            "shapes": {k: [dict(s) for s in v] for k, v in self.shapes.items()},
        }


# ----------------------------------------------------------------------------------------------- tree helpers

def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested dict/list/tuple ``obj``; other leaves are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(fn, v) for v in obj)
    return obj


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t), obj)
    return out


def clone_tree(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().clone(), obj)


def to_fp64(obj: Any) -> Any:
    """Floating tensors -> float64 copies (exact); integer tensors are cloned unchanged."""
    return tree_map(lambda t: t.detach().to(torch.float64) if t.is_floating_point() else t.detach().clone(), obj)


def flat(x: torch.Tensor | list | tuple) -> torch.Tensor:
    """One flat tensor from a tensor or a list of tensors (all elements, in order)."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)
    return torch.cat([t.reshape(-1) for t in x])


def nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_tensors(obj))
