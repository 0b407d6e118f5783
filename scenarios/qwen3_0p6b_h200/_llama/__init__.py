"""Shared parts of the forged Llama engines, composed by each engine (nothing here is an engine itself).

* :mod:`.model`    -- the Megatron-mirror Llama decoder (sequence-first, fused QKV / fc1, TP layout).
* :mod:`.parallel` -- :class:`~.parallel.ParallelState`, Megatron-DDP's flat grad buffer and ZeRO-1 shards
  (``GradBuffer``), the TP splits and the process groups.
* :mod:`.optim`    -- the optimizer step: Megatron's grad norm and clipping, torch AdamW's arithmetic (single
  tensor, foreach, fused, Triton) and the ZeRO-1 AdamW state.
* :mod:`.layout`   -- the forged <-> HF weight layouts, Megatron's grad-norm order, the module probes.

Modules here import each other relatively, so the forge can copy the package into a workspace engine as
``engine/_llama/`` and the copy stays self-contained (:mod:`forgetrain.forge.workspace`).
"""
