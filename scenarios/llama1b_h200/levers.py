"""The Hopper engine's lever table: every ``engine.*`` switch it reads, with its type, values, default, its value
under ``mode=exact`` and ``mode=fast_base``, the tier it declares, what it needs and a one-line doc
(:class:`forgetrain.levers.Lever`), and what the engine implements (:data:`SPEC`, ``Engine.spec``).

This table is the one place a lever is declared: the harness builds the ``engine.*`` config group, checks each
value, runs each lever's rule and derives the mode presets from it; ``optimisations.yaml`` keeps each lever's
evidence, under the lever's name. A new lever is one row here, its code in the engine, and its test
(docs/design.md, "A new engine lever"). A leaf: it imports no torch, so the config reads it at once.

Tiers (strictest first: bitwise, tolerance, loss_curve) are the weakest each lever declares it may be judged at.
The memory layout (recompute, per-layer bf16 weights, optimizer offload) is bitwise by construction and keeps the
scenario's value under both presets (``KEEP``), as do the fast-mode knobs exact mode never reads.
"""

from __future__ import annotations

from typing import Optional

from forgetrain.levers import COMPILE_TUNINGS, EngineSpec, Lever

FP8_RECIPES = ("none", "tensorwise")  # engine.fp8 (fp8.py implements them)
_EXACT = ("(for exact mode use mode=exact, which turns every fast-only switch off (each lever's exact value, "
          "scenarios/llama1b_h200/levers.py); a key after it on the command line turns that switch back on)")


def _fast_only(name: str, why: str):
    """The rule of a boolean fast-only lever: refused outside ``engine.mode=fast``, pointing at ``mode=exact``."""
    def rule(cfg, reference):
        if getattr(cfg.engine, name) and cfg.engine.mode != "fast":
            return f"engine.{name}=true needs engine.mode=fast ({why}); drop engine.{name}=true {_EXACT}"
        return None
    return rule


def _onepass(cfg, reference):
    e = cfg.engine
    if e.onepass_optimizer and (e.mode != "fast" or cfg.kernels.adamw != "triton" or cfg.parallel.zero_stage != 0):
        return ("engine.onepass_optimizer=true needs engine.mode=fast, kernels.adamw=triton and parallel.zero_stage=0;"
                f" got mode={e.mode}, adamw={cfg.kernels.adamw}, zero_stage={cfg.parallel.zero_stage}"
                + (f"; drop engine.onepass_optimizer=true {_EXACT}" if e.mode != "fast"
                   else "; or set engine.onepass_optimizer=false"))
    return None


def _compile_tuning(cfg, reference):
    if cfg.engine.compile_tuning != "none" and cfg.engine.mode != "fast":
        return (f"engine.compile_tuning={cfg.engine.compile_tuning} needs engine.mode=fast (exact mode compiles "
                "nothing); drop engine.compile_tuning")
    return None


def _fp8(cfg, reference):
    if cfg.engine.fp8 != "none" and cfg.engine.mode != "fast":
        return (f"engine.fp8={cfg.engine.fp8} needs engine.mode=fast (exact mode is the bitwise mirror of "
                "Megatron-core's GEMMs); drop engine.fp8 or set engine.fp8=none")
    return None


def _fp8_lm_head(cfg, reference):
    if cfg.engine.fp8_lm_head and (cfg.engine.fp8 == "none" or cfg.kernels.cross_entropy != "chunked"):
        return ("engine.fp8_lm_head=true needs engine.fp8=tensorwise and kernels.cross_entropy=chunked (the LM head's "
                f"FP8 GEMMs run in the chunked cross-entropy); got engine.fp8={cfg.engine.fp8}, "
                f"kernels.cross_entropy={cfg.kernels.cross_entropy}")
    return None


def _recompute_num_layers(cfg, reference):
    rnl = cfg.engine.recompute_num_layers
    if rnl is not None and (cfg.engine.recompute != "full" or isinstance(rnl, bool) or not isinstance(rnl, int)
                            or not 0 <= rnl <= cfg.model.num_layers):
        return (f"engine.recompute_num_layers must be an integer from 0 to model.num_layers ({cfg.model.num_layers}) "
                f"with engine.recompute=full (null: every layer); got {rnl!r} with recompute={cfg.engine.recompute}")
    return None


def _offload(cfg, reference):
    off = cfg.engine.optimizer_offload_fraction
    if isinstance(off, bool) or not isinstance(off, (int, float)) or not 0.0 <= off <= 1.0:
        return f"engine.optimizer_offload_fraction must be a number from 0 to 1, got {off!r}"
    if not reference and off > 0 and (cfg.parallel.zero_stage != 0 or cfg.engine.onepass_optimizer):
        return ("engine.optimizer_offload_fraction > 0 needs parallel.zero_stage=0 and engine.onepass_optimizer=false; "
                f"got zero_stage={cfg.parallel.zero_stage}, onepass_optimizer={cfg.engine.onepass_optimizer}")
    return None


def per_layer_possible(cfg) -> bool:
    """Whether ``engine.bf16_weights=per_layer`` can run with ``cfg``'s precision and layout (with
    ``engine.recompute=full``): bf16 on one GPU without ZeRO."""
    return cfg.train.precision == "bf16" and cfg.parallel.data_parallel_size == 1 and cfg.parallel.zero_stage == 0


def _bf16_weights(cfg, reference):
    if not reference and cfg.engine.bf16_weights == "per_layer" and (cfg.engine.recompute != "full"
                                                                      or not per_layer_possible(cfg)):
        return ("engine.bf16_weights=per_layer needs engine.recompute=full, train.precision=bf16 and one GPU without "
                f"ZeRO; got recompute={cfg.engine.recompute}, precision={cfg.train.precision}, data_parallel_size="
                f"{cfg.parallel.data_parallel_size}, zero_stage={cfg.parallel.zero_stage}")
    return None


def _ce_chunk_tokens(cfg, reference):
    if cfg.engine.ce_chunk_tokens is not None and cfg.engine.ce_chunk_tokens <= 0:
        return f"engine.ce_chunk_tokens must be positive, got {cfg.engine.ce_chunk_tokens}"
    return None


LEVERS = (  # in the order validation checks them (each value, then its rule); engine.mode, the harness's, first
    Lever("grad_accum_fusion", bool, False, "tolerance", "weight-gradient GEMMs write/accumulate straight into the "
          "fp32 main_grad (Megatron's gradient accumulation fusion; wgrad.py)", exact=False, fast_base=False,
          needs="engine.mode=fast", rule=_fast_only("grad_accum_fusion", "exact mode is the bitwise Megatron "
                                                     "mirror: its grads stay bf16 .grad added into main_grad")),
    Lever("onepass_optimizer", bool, False, "tolerance", "the optimizer step as one pass: the grad norm stays on the "
          "device, clipping folded into the Triton AdamW kernel, which writes the bf16 weights", exact=False,
          fast_base=False, needs="engine.mode=fast, kernels.adamw=triton, parallel.zero_stage=0", rule=_onepass),
    Lever("compile_tuning", str, "none", "tolerance", "how inductor picks its kernels' launch parameters for every "
          "torch.compile the engine makes: none (heuristics) | coordinate_descent (a search at the first step)",
          values=tuple(COMPILE_TUNINGS), exact="none", fast_base="none", needs="engine.mode=fast",
          rule=_compile_tuning),
    Lever("fp8", str, "none", "loss_curve", "the decoder layers' linear layers run their GEMMs with FP8 operands: "
          "none | tensorwise (dynamic per-tensor scales; e4m3 activations and weights, e5m2 gradients; fp8.py)",
          values=FP8_RECIPES, exact="none", fast_base="none", needs="engine.mode=fast", rule=_fp8),
    Lever("fp8_lm_head", bool, False, "loss_curve", "the LM head's three GEMMs per cross-entropy chunk run with FP8 "
          "operands too, by engine.fp8's recipe (fp8.HeadWeight); the cross-entropy stays fp32", exact=False,
          fast_base=False, needs="engine.fp8=tensorwise, kernels.cross_entropy=chunked", rule=_fp8_lm_head),
    Lever("free_qkv", bool, False, "tolerance", "V is copied out of the fused QKV output, so the saved V no longer "
          "keeps the whole [tokens, (nq + 2 nkv) d] buffer alive ((nq + nkv) d bf16 values less per token and layer)",
          exact=False, fast_base=False, needs="engine.mode=fast",
          rule=_fast_only("free_qkv", "exact mode's attention is Megatron's unfused one")),
    Lever("compile", bool, False, "loss_curve", "torch.compile each transformer block (inductor fuses elementwise "
          "ops and may reorder reductions)", exact=False, fast_base=False, needs="engine.mode=fast",
          rule=_fast_only("compile", "exact mode runs Megatron's ops eagerly, op by op")),
    Lever("recompute", str, "none", "bitwise", "activation recompute of the decoder layers: none | full (Megatron's "
          "full, uniform recompute, one layer per checkpoint; the same ops again)", values=("none", "full")),
    Lever("recompute_num_layers", Optional[int], None, "bitwise", "under recompute=full, the first N layers are "
          "recomputed (Megatron's block method), the others store their activations; null: every layer",
          needs="engine.recompute=full, 0 <= N <= model.num_layers", rule=_recompute_num_layers),
    Lever("optimizer_offload_fraction", float, 0.0, "bitwise", "fraction (0..1) of the AdamW moments kept in host "
          "memory, largest tensors first, streamed through the GPU in chunks for the same elementwise update",
          needs="parallel.zero_stage=0, engine.onepass_optimizer=false", rule=_offload),
    Lever("bf16_weights", str, "resident", "bitwise", "where the decoder layers' bf16 working weights live: resident "
          "(a copy beside the fp32 main weights) | per_layer (cast when a layer's forward or recompute starts)",
          values=("resident", "per_layer"), needs="engine.recompute=full, train.precision=bf16, one GPU, no ZeRO",
          rule=_bf16_weights),
    Lever("ce_chunk_tokens", int, 4096, "tolerance", "tokens per LM-head/cross-entropy chunk (the dW sum runs per "
          "chunk; kernels.cross_entropy=chunked|triton, whose tier is in forgetrain/kernels/switches.py)",
          needs="kernels.cross_entropy=chunked|triton", rule=_ce_chunk_tokens),
    Lever("attention_backend", str, "cudnn", "loss_curve", "fast mode's SDPA backend preference on CUDA: cudnn | "
          "default (flash/cuDNN attention reorders the softmax reductions)", needs="engine.mode=fast"),
)

SPEC = EngineSpec(
    levers=LEVERS,
    modes=("exact", "fast"),
    recompute=True,  # engine.recompute=full and engine.bf16_weights=per_layer (scenarios/_llama/recompute)
    recompute_num_layers=True,  # engine.recompute_num_layers: the first N layers only
    optimizer_offload=True,  # engine.optimizer_offload_fraction (scenarios/_llama/optim.HostMoments)
    # engine.mode[/device] -> non-default kernels.* values honoured (forgetrain/kernels/switches.py). Exact mode
    # keeps Megatron's ops (only the optimizer step is switchable); torch's fused AdamW runs on CUDA only.
    kernel_switches={
        "fast": {"rmsnorm": ("triton",), "swiglu": ("triton",), "rope": ("triton",),
                 "cross_entropy": ("chunked", "triton"), "ce_chunk": ("triton",), "adamw": ("triton",)},
        "fast/cuda": {"adamw": ("fused",)},
        "exact": {"adamw": ("triton",)},
        "exact/cuda": {"adamw": ("fused",)},
    },
)
