"""The protocol every training engine (forged scenario or reference) implements.

The harness (``forgetrain.train``) owns the loop around an engine: data order, trace, checkpoints, logging and
evaluation. The engine owns one optimizer step end to end: forward, backward, gradient accumulation, clipping,
LR schedule and the optimizer update. That split is what lets a forged engine fuse freely while both sides see
identical inputs.

Neutral layouts
---------------
* Weights and gradients cross the boundary in the **HF-Llama layout** (``model.embed_tokens.weight``,
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
  ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``; Qwen3's
  ``model.layers.{i}.self_attn.{q,k}_norm.weight``, and no ``lm_head.weight`` when it is tied; Qwen3-MoE's
  ``model.layers.{i}.mlp.gate.weight`` and ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``:
  :func:`hf_names`),
  fp32, ``[out_features, in_features]``. q/k rows are in Megatron/Meta order (no HF rotary permutation): both
  engines use rotate-half RoPE on the same head-dim order, so the exchange is a pure re-slicing of QKV/fc1.
* Module probes use neutral names: ``embedding``, ``layers.{i}.input_norm``, ``layers.{i}.self_attention``,
  ``layers.{i}.pre_mlp_norm``, ``layers.{i}.mlp``, ``final_norm``, ``output_layer``. Each probe's first tensor
  output is recorded (``[s, b, h]`` sequence-first; ``output_layer`` gives ``[s, b, vocab]``).

Batches
-------
A micro-batch is an int64 tensor ``[micro_batch_size, seq_length + 1]`` of token ids: inputs are ``[:, :-1]``,
labels ``[:, 1:]``. Every label position counts in the loss (no padding, no loss mask).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

import torch

HF_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "q_norm.weight",
                    "k_norm.weight")


@dataclass
class StepResult:
    """What one optimizer step reports.

    loss: mean per-token cross-entropy over all micro-batches of this rank's step, nats (Megatron's reported loss:
        the mean over micro-batches of each micro-batch's token mean).
    grad_norm: global L2 norm of the accumulated gradient before clipping.
    lr: learning rate used by this step's update.
    per_token_loss: fp32 ``[num_micro_batches, micro_batch_size, seq_length]`` per-token losses (for digests).
    extra: JSON-able per-step values beyond the standard record, written into the step's trace record under their
        own keys (``forgetrain.run.loop``; a key of the standard record is refused with ValueError there). A
        mixture of experts reports ``moe_tokens_per_expert`` (per layer, per expert: tokens routed there over the
        step's micro-batches) and ``moe_load_balancing_loss`` (per layer: the unweighted load-balancing loss, mean
        over micro-batches; only with ``moe_aux_loss_coeff > 0``); an engine that drops tokens at a capacity
        limit also reports ``moe_dropped_tokens`` (tokens, an int or per layer). The harness shows their scalars
        (:func:`forgetrain.metrics.moe_metrics`) and the bitwise tier compares the first two exactly.
    """

    loss: float
    grad_norm: float
    lr: float
    per_token_loss: torch.Tensor | None = None
    extra: dict | None = None


@runtime_checkable
class TrainEngine(Protocol):
    """Constructed as ``Engine(cfg: RunConfig, device: torch.device)``; the process group, if any, already exists.

    ``init_weights`` must be deterministic in ``cfg.train.seed``. ``train_step`` raises ValueError on a
    micro-batch of the wrong shape.
    """

    def init_weights(self) -> None: ...

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None: ...

    def export_hf_weights(self) -> dict[str, torch.Tensor]: ...

    def export_hf_grads(self) -> dict[str, torch.Tensor]: ...

    # Optional, not part of the protocol check: ``export_hf_clipped_grads() -> dict[str, Tensor] | None``, the
    # gradients the last update applied (after clipping), HF layout; without it (or when it returns None) the
    # harness derives them from export_hf_grads() as Megatron clips (``forgetrain.train.clipped_grads``).

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult: ...

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def module_probes(self) -> dict[str, torch.nn.Module]: ...

    def logits(self, tokens: torch.Tensor) -> torch.Tensor: ...


def forward_names(num_layers: int) -> Iterable[str]:
    """Neutral module-probe names in forward order."""
    yield "embedding"
    for i in range(num_layers):
        yield f"layers.{i}.input_norm"
        yield f"layers.{i}.self_attention"
        yield f"layers.{i}.pre_mlp_norm"
        yield f"layers.{i}.mlp"
    yield "final_norm"
    yield "output_layer"


def hf_param_names(num_layers: int, qk_layernorm: bool = False, tied: bool = False,
                   num_experts: int | None = None) -> list[str]:
    """HF-Llama parameter names in forward order; ``qk_layernorm``: with HF Qwen3's per-head
    ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight`` ``[d]`` after ``k_proj``; ``tied`` (shared embedding
    and LM head): no ``lm_head.weight``, as HF saves a tied model; ``num_experts`` E (HF Qwen3-MoE): each layer's
    MLP is the router ``mlp.gate.weight`` ``[E, h]`` and per expert e ``mlp.experts.{e}.{gate,up,down}_proj.weight``
    instead of the dense ``mlp.{gate,up,down}_proj.weight``."""
    names = ["model.embed_tokens.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight"]
        if qk_layernorm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if num_experts is None:
            names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
        else:
            names.append(p + "mlp.gate.weight")
            for e in range(num_experts):
                names += [f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
    names += ["model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    return names


def hf_names(model_cfg) -> list[str]:
    """:func:`hf_param_names` of a ModelConfig (its layers, QK-norm, tying and experts)."""
    return hf_param_names(model_cfg.num_layers, model_cfg.qk_layernorm, model_cfg.share_embeddings_and_output_weights,
                          model_cfg.num_experts)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model.eval()`` for the block, then the previous train/eval mode again (also after an exception)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def check_tokens(tokens: torch.Tensor, seq_length: int) -> None:
    """Validate ``logits()`` input: int tokens ``[b, s]`` with ``s <= seq_length``. Raises ValueError."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, s], got {tuple(tokens.shape)}")
    if tokens.shape[1] > seq_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.seq_length={seq_length}")
