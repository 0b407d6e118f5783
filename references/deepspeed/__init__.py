"""A second, independent reference: DeepSpeed (ZeRO-1/2) driving HF transformers' ``LlamaForCausalLM``.

``engine.Engine`` implements :class:`forgetrain.engine.TrainEngine`. It is found through ``forgetrain.registry``
(``verify.reference=deepspeed``); nothing here is imported by the harness at module level, and importing this
package does not import deepspeed or transformers (the ``deepspeed`` extra of pyproject.toml). See README.md for
where its arithmetic differs from the Megatron reference and which tier that leaves reachable.
"""
