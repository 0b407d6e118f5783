"""The Megatron-mirror Qwen3-MoE decoder: the dense Qwen3 decoder (``._llama.model``: QK-norm attention, RMSNorm,
embedding, LM head, cross-entropy) with every layer's MLP a mixture of experts (:class:`.moe.MoE`).

Shapes: ids ``[b, s]`` int64; activations sequence-first ``[s, b, h]``; logits ``[s, b, V]``; per-token loss
``[b, s]`` fp32 (nats).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._llama.model import Attention, Embedding, OutputLayer, RMSNorm, cross_entropy, rope_freqs
from .moe import MoE


class Block(nn.Module):
    """``x -> x + attn(input_norm(x)) -> x + moe(pre_mlp_norm(x))`` (Megatron's TransformerLayer, no dropout)."""

    def __init__(self, cfg):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attn = Attention(cfg)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MoE(cfg)

    def forward(self, x, freqs, mask):
        x = x + self.attn(self.input_norm(x), freqs, mask)
        return x + self.mlp(self.pre_mlp_norm(x))


OUTPUT_PROJECTIONS = ("attn.proj", ".fc2")  # Megatron: self_attention.linear_proj, each expert's linear_fc2


def init_std(name: str, cfg) -> float:
    """The standard deviation Megatron-core 0.16.1 draws parameter ``name`` from: N(0, init_method_std) for every
    matrix (QKV, the router, each expert's fc1, the embedding, the LM head), N(0, init_method_std /
    sqrt(2 * num_layers)) for those writing into the residual stream (attention's output projection, each expert's
    fc2: ``TransformerConfig.output_layer_init_method``)."""
    if name.endswith(OUTPUT_PROJECTIONS):
        return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    return cfg.init_method_std


class Qwen3MoE(nn.Module):
    """``forward(ids [b, s], labels [b, s] | None)`` -> per-token loss ``[b, s]`` fp32, or logits ``[s, b, V]``.
    TP = 1 only."""

    def __init__(self, cfg, deterministic: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg.vocab_size, cfg.hidden_size, index_lookup=deterministic)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        tied = self.embedding.weight if cfg.share_embeddings_and_output_weights else None
        self.output_layer = OutputLayer(cfg.vocab_size, cfg.hidden_size, shared=tied)
        self._freqs: dict = {}

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """1-D (RMSNorm) weights to ones, every matrix from N(0, :func:`init_std`), drawn in parameter order."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, init_std(name, self.cfg), generator=generator)

    def moe_layers(self) -> list[MoE]:
        return [blk.mlp for blk in self.layers]

    def _rope_and_mask(self, s: int, device):
        key = (s, str(device))
        if key not in self._freqs:
            freqs = rope_freqs(s, self.cfg.head_dim, self.cfg.rotary_base, device)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
            self._freqs[key] = (freqs, mask)
        return self._freqs[key]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        freqs, mask = self._rope_and_mask(ids.shape[1], ids.device)
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x, freqs, mask)
        logits = self.output_layer(self.final_norm(x))
        if labels is None:
            return logits
        return cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
