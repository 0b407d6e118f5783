"""The golden reference: megatron-core 0.16.1 (local layer spec) behind forgetrain's TrainEngine protocol.

``engine.Engine`` is the engine; ``convert`` maps Megatron <-> HF-Llama state dicts; ``shim`` is the CPU device
shim (installed only for CPU runs). Nothing here is imported by the harness at module level; it is found through
``forgetrain.registry``. See README.md for the numerics a forged engine must mirror.
"""
