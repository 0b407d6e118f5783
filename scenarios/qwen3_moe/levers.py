"""What the Qwen3-MoE engine implements (:data:`SPEC`, ``Engine.spec``): exact mode only, the op-by-op
Megatron-core mirror, with Qwen3's model features and the mixture of experts (``model.num_experts``). It has no
``engine.*`` lever of its own. A leaf: it imports no torch."""

from __future__ import annotations

from forgetrain.levers import EngineSpec

SPEC = EngineSpec(
    modes=("exact",),
    # the ModelConfig features beyond Llama it runs (forgetrain.levers.MODEL_FEATURES)
    model_features=("qk_layernorm", "share_embeddings_and_output_weights", "kv_channels", "num_experts"),
    # exact mode keeps Megatron's ops; only the optimizer step is switchable, torch's fused AdamW on CUDA only
    kernel_switches={"exact": {"adamw": ("triton",)}, "exact/cuda": {"adamw": ("fused",)}},
)
