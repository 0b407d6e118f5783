"""Weight layouts of the Qwen3-MoE engine (:mod:`.model`): the exchange with HF Qwen3-MoE names, Megatron's
grad-norm order and the module probes. Pure functions of the ModelConfig ``m``.

Forged names: ``embedding.weight`` ``[V, h]``; per layer ``i``: ``layers.i.attn.qkv`` ``[nkv*(nq/nkv+2)*d, h]``
(per KV group its q heads, then k, then v), ``layers.i.attn.proj`` ``[h, nq*d]``, with ``qk_layernorm``
``layers.i.attn.q_norm.weight`` / ``k_norm.weight`` ``[d]``, ``layers.i.input_norm.weight`` and
``layers.i.pre_mlp_norm.weight`` ``[h]``, ``layers.i.mlp.router`` ``[E, h]`` (HF ``mlp.gate.weight``),
``layers.i.mlp.experts.e.fc1`` ``[2 f_e, h]`` (``[gate; up]``) and ``layers.i.mlp.experts.e.fc2`` ``[h, f_e]``;
``final_norm.weight`` ``[h]``; ``output_layer.weight`` ``[V, h]``, absent when tied.
"""

from __future__ import annotations

import torch


def norm_order(m) -> list[str]:
    """Megatron's grad-norm order (its optimizer's parameter order, one optimizer at EP = 1): 2-D weights in
    module order (per layer proj, qkv, router, then each expert's fc1 and fc2), then the 1-D norm weights (per
    layer the input norm, q / k norms, the pre-MLP norm; the final norm)."""
    two_d, one_d = ["embedding.weight"], []
    for i in range(m.num_layers):
        p = f"layers.{i}."
        two_d += [p + "attn.proj", p + "attn.qkv", p + "mlp.router"]
        for e in range(m.num_experts):
            two_d += [f"{p}mlp.experts.{e}.fc1", f"{p}mlp.experts.{e}.fc2"]
        qk = [p + "attn.q_norm.weight", p + "attn.k_norm.weight"] if m.qk_layernorm else []
        one_d += [p + "input_norm.weight", *qk, p + "pre_mlp_norm.weight"]
    if not m.share_embeddings_and_output_weights:
        two_d.append("output_layer.weight")
    one_d.append("final_norm.weight")
    return two_d + one_d


def to_hf(m, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forged-layout tensors -> HF Qwen3-MoE names and shapes, fp32 CPU copies. Raises KeyError."""
    qpg, d, f = m.num_attention_heads // m.num_query_groups, m.head_dim, m.expert_ffn_hidden_size
    out = {"model.embed_tokens.weight": t["embedding.weight"]}
    for i in range(m.num_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        qkv = t[p + "attn.qkv"].view(m.num_query_groups, qpg + 2, d, m.hidden_size)
        out[hp + "self_attn.q_proj.weight"] = qkv[:, :qpg].reshape(-1, m.hidden_size)
        out[hp + "self_attn.k_proj.weight"] = qkv[:, qpg].reshape(-1, m.hidden_size)
        out[hp + "self_attn.v_proj.weight"] = qkv[:, qpg + 1].reshape(-1, m.hidden_size)
        out[hp + "self_attn.o_proj.weight"] = t[p + "attn.proj"]
        if m.qk_layernorm:
            out[hp + "self_attn.q_norm.weight"] = t[p + "attn.q_norm.weight"]
            out[hp + "self_attn.k_norm.weight"] = t[p + "attn.k_norm.weight"]
        out[hp + "mlp.gate.weight"] = t[p + "mlp.router"]
        for e in range(m.num_experts):
            fc1, he = t[f"{p}mlp.experts.{e}.fc1"], f"{hp}mlp.experts.{e}."
            out[he + "gate_proj.weight"] = fc1[:f]
            out[he + "up_proj.weight"] = fc1[f:]
            out[he + "down_proj.weight"] = t[f"{p}mlp.experts.{e}.fc2"]
        out[hp + "input_layernorm.weight"] = t[p + "input_norm.weight"]
        out[hp + "post_attention_layernorm.weight"] = t[p + "pre_mlp_norm.weight"]
    out["model.norm.weight"] = t["final_norm.weight"]
    if not m.share_embeddings_and_output_weights:
        out["lm_head.weight"] = t["output_layer.weight"]
    return {k: v.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous() for k, v in out.items()}


def from_hf(m, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE tensors -> forged names and shapes (inverse of :func:`to_hf`; no copy, no dtype change).
    Raises KeyError for a missing HF name, ValueError for a tied LM head that differs from the embedding."""
    if m.share_embeddings_and_output_weights and "lm_head.weight" in sd and not torch.equal(
            sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
        raise ValueError("share_embeddings_and_output_weights: lm_head.weight differs from model.embed_tokens.weight")
    qpg, d = m.num_attention_heads // m.num_query_groups, m.head_dim
    out = {"embedding.weight": sd["model.embed_tokens.weight"]}
    for i in range(m.num_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        q = sd[hp + "self_attn.q_proj.weight"].view(m.num_query_groups, qpg, d, m.hidden_size)
        k = sd[hp + "self_attn.k_proj.weight"].view(m.num_query_groups, 1, d, m.hidden_size)
        v = sd[hp + "self_attn.v_proj.weight"].view(m.num_query_groups, 1, d, m.hidden_size)
        out[p + "attn.qkv"] = torch.cat([q, k, v], dim=1).reshape(-1, m.hidden_size)
        out[p + "attn.proj"] = sd[hp + "self_attn.o_proj.weight"]
        if m.qk_layernorm:
            out[p + "attn.q_norm.weight"] = sd[hp + "self_attn.q_norm.weight"]
            out[p + "attn.k_norm.weight"] = sd[hp + "self_attn.k_norm.weight"]
        out[p + "mlp.router"] = sd[hp + "mlp.gate.weight"]
        for e in range(m.num_experts):
            he = f"{hp}mlp.experts.{e}."
            out[f"{p}mlp.experts.{e}.fc1"] = torch.cat([sd[he + "gate_proj.weight"], sd[he + "up_proj.weight"]])
            out[f"{p}mlp.experts.{e}.fc2"] = sd[he + "down_proj.weight"]
        out[p + "input_norm.weight"] = sd[hp + "input_layernorm.weight"]
        out[p + "pre_mlp_norm.weight"] = sd[hp + "post_attention_layernorm.weight"]
    out["final_norm.weight"] = sd["model.norm.weight"]
    if not m.share_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"]
    return out


def module_probes(model) -> dict[str, torch.nn.Module]:
    """The modules whose outputs / output gradients the trace digests, by Megatron's module names (``embedding``,
    ``layers.i.{input_norm,self_attention,pre_mlp_norm,mlp}``, ``final_norm``, ``output_layer``)."""
    probes = {"embedding": model.embedding}
    for i, blk in enumerate(model.layers):
        probes[f"layers.{i}.input_norm"] = blk.input_norm
        probes[f"layers.{i}.self_attention"] = blk.attn
        probes[f"layers.{i}.pre_mlp_norm"] = blk.pre_mlp_norm
        probes[f"layers.{i}.mlp"] = blk.mlp
    probes["final_norm"] = model.final_norm
    probes["output_layer"] = model.output_layer
    return probes
