"""Forged engine for ``llama8b_h100``: the Hopper Llama engine of ``llama1b_h200`` at the Llama-3-8B shape.

The architecture is the same; only the config differs (hidden 4096, FFN 14336, seq 8192). Keeping one
implementation means an optimisation proven on one scenario carries its evidence to the other.
"""

from scenarios.llama1b_h200.engine import Engine as _HopperEngine


class Engine(_HopperEngine):
    name = "llama8b_h100"
