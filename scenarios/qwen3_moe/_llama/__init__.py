"""The dense parts of the forged Qwen3 engine (``scenarios/qwen3_0p6b_h200/_llama``), copied unchanged so this
engine owns its code: :mod:`.model` (the Megatron-mirror attention with QK-norm, RMSNorm, embedding, LM head,
linear and cross-entropy) and :mod:`.optim` (Megatron's grad norm and clipping, torch AdamW's arithmetic). Modules
here import each other relatively."""
