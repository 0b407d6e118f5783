"""The strong ``torch_compile`` script with torchao's float8 training on its decoder linears.

``references/torchao_float8_tensorwise`` and ``references/torchao_float8_rowwise`` are :class:`Float8Engine` with
``recipe`` "tensorwise" or "rowwise": the model of :mod:`references.torch_compile.engine` (bf16 parameters, fp32
masters, fused QKV and gate/up, SDPA, the whole model under ``torch.compile``), whose decoder-layer
``nn.Linear`` modules (``layers.*``: qkv, o, gate/up, down; both dimensions multiples of 16, as torch's
``_scaled_mm`` needs) are swapped for torchao ``Float8Linear`` by
``torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))`` before
compilation, the way torchao's README and torchtitan apply it. The embedding, the LM head, attention and the norms
stay bf16. Dynamic scaling: tensorwise (one scale per tensor) or rowwise (one per row, power-of-2 scales, torchao's
more accurate recipe).

Needs the optional ``torchao`` extra (``pip install -e '.[torchao]'``; the side's ``extra``, so a missing package is
one ConfigError line naming the pin) and a CUDA device with FP8 GEMMs (compute capability 8.9 or later:
:meth:`Float8Engine.check_run`, called by ``forgetrain.bench`` before anything is built). ``Float8Engine.emulate``
(False) is torchao's ``emulate`` switch: FP8 casts with high-precision matmuls, which the CPU tests set to run the
conversion and a step; never set for timing.
"""

from __future__ import annotations

import dataclasses

from references.torch_compile.engine import Engine as StrongEngine

FP8_CAPABILITY = (8, 9)  # Ada / Hopper: the first CUDA compute capability with FP8 tensor-core GEMMs
RECIPES = ("tensorwise", "rowwise")


def fp8_refusal(cfg, name: str) -> str | None:
    """Why side ``name`` cannot run ``cfg`` here (one line), or None: ``hardware.device`` is not cuda, no CUDA
    device is visible, or the device's compute capability is below 8.9."""
    import torch

    need = f"{name} needs a CUDA device with FP8 GEMMs (compute capability {'.'.join(map(str, FP8_CAPABILITY))} " \
           f"or later)"
    if cfg.hardware.device != "cuda":
        return f"{need}; this run has hardware.device={cfg.hardware.device} (use e.g. hardware=h200)"
    if not torch.cuda.is_available():
        return f"{need}; no CUDA device is visible"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) < FP8_CAPABILITY:
        return f"{need}; {torch.cuda.get_device_name()} has compute capability {'.'.join(map(str, cap))}"
    return None


def float8_config(recipe: str, emulate: bool = False):
    """torchao's ``Float8LinearConfig.from_recipe_name(recipe)`` (recipe: tensorwise | rowwise), with torchao's
    ``emulate`` switch set when asked. Raises ValueError for another recipe; ImportError without torchao."""
    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe must be {' or '.join(RECIPES)}, got '{recipe}'")
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=True) if emulate else cfg


def decoder_linear(module, fqn: str) -> bool:
    """The module filter of the conversion: an ``nn.Linear`` inside the decoder layers (``layers.*``) whose input and
    output sizes are multiples of 16 (``_scaled_mm``'s alignment). The LM head and the embedding are left bf16."""
    import torch

    return (isinstance(module, torch.nn.Linear) and fqn.startswith("layers.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


class Float8Engine(StrongEngine):
    """:class:`references.torch_compile.engine.Engine` with torchao float8 training on the decoder linears (module
    doc); subclasses set ``name`` and ``recipe``."""

    recipe = "tensorwise"
    emulate = False  # torchao's emulation (CPU tests only: FP8 casts, high-precision matmuls)
    extra = ("torchao", ("torchao",))  # forgetrain.registry: a missing torchao is one ConfigError line

    @classmethod
    def check_run(cls, cfg) -> None:
        """Raises ConfigError when this side cannot run ``cfg`` on this machine (:func:`fp8_refusal`)."""
        from forgetrain.errors import ConfigError

        if not cls.emulate and (why := fp8_refusal(cfg, f"bench side '{cls.name}' (torchao float8 {cls.recipe})")):
            raise ConfigError(why)

    def __init__(self, cfg, device):
        self.check_run(cfg)
        self.float8_linears = 0
        super().__init__(cfg, device)

    def convert_model(self) -> None:
        """Swap the decoder linears for torchao ``Float8Linear`` (same weight parameters), before compilation."""
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        convert_to_float8_training(self.model, config=float8_config(self.recipe, self.emulate),
                                   module_filter_fn=decoder_linear)
        self.float8_linears = sum(isinstance(m, Float8Linear) for m in self.model.modules())

    @property
    def bench_info(self) -> dict:
        """The strong side's info, plus ``fp8`` (the recipe), ``fp8_by`` (what applies it) and ``float8_linears``
        (how many linears were swapped)."""
        import torchao

        return {**super().bench_info, "fp8": self.recipe, "float8_linears": self.float8_linears,
                "fp8_by": f"torchao {torchao.__version__} convert_to_float8_training, recipe {self.recipe}"}
