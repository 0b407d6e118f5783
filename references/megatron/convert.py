"""Megatron GPTModel (local layer spec, TP=1) <-> HF-Llama state-dict conversion. Pure re-slicing, no arithmetic.

Megatron names (``GPTModel.state_dict()`` without a wrapper prefix) and their HF counterparts:

=============================================================  ==================================================
``embedding.word_embeddings.weight``        [V, h]              ``model.embed_tokens.weight``
``decoder.layers.{i}.input_layernorm.weight``     [h]           ``model.layers.{i}.input_layernorm.weight``
``decoder.layers.{i}.self_attention.linear_qkv.weight``         ``...self_attn.{q,k,v}_proj.weight`` (see below)
``decoder.layers.{i}.self_attention.linear_proj.weight`` [h, np*d]  ``...self_attn.o_proj.weight``
``decoder.layers.{i}.pre_mlp_layernorm.weight``   [h]           ``model.layers.{i}.post_attention_layernorm.weight``
``decoder.layers.{i}.mlp.linear_fc1.weight``  [2*ffn, h]        ``...mlp.gate_proj.weight`` ; ``...mlp.up_proj.weight``
``decoder.layers.{i}.mlp.linear_fc2.weight``  [h, ffn]          ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``          [h]                 ``model.norm.weight``
``output_layer.weight``                     [V, h]              ``lm_head.weight``
=============================================================  ==================================================

``linear_qkv`` rows are grouped by query group (Megatron's ``get_query_key_value_tensors`` views the output as
``[s, b, ng, (np/ng + 2) * d]``): for each group ``g`` in order, the ``np/ng`` query heads of that group
(query head ``j`` of group ``g`` is global head ``g * np/ng + j``), then the group's key head, then its value
head, each ``d`` rows. ``linear_fc1`` is ``[gate; up]``: Megatron's gated linear unit applies the activation to
the first half (``act(x[0]) * x[1]`` after ``chunk(2, -1)``). q/k rows keep Megatron's rotate-half head-dim order
(no HF rotary permutation). Tensors are returned as contiguous copies in the input dtype; callers cast.
"""

from __future__ import annotations

import torch

EXTRA_STATE_SUFFIX = "._extra_state"


def _dims(model_cfg) -> tuple[int, int, int, int]:
    np_ = model_cfg.num_attention_heads
    ng = model_cfg.num_query_groups
    d = model_cfg.hidden_size // np_
    if np_ % ng:
        raise ValueError(f"num_query_groups={ng} does not divide num_attention_heads={np_}")
    return np_, ng, np_ // ng, d


def megatron_param_names(num_layers: int) -> list[str]:
    """Megatron GPTModel parameter names (local spec, untied output layer) in forward order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return names


def split_qkv(qkv: torch.Tensor, model_cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron grouped ``linear_qkv`` rows -> (q [np*d, ...], k [ng*d, ...], v [ng*d, ...])."""
    np_, ng, per, d = _dims(model_cfg)
    if qkv.shape[0] != ng * (per + 2) * d:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, expected ng*(np/ng+2)*d = {ng * (per + 2) * d}")
    g = qkv.reshape(ng, (per + 2) * d, *qkv.shape[1:])
    q = g[:, : per * d].reshape(np_ * d, *qkv.shape[1:])
    k = g[:, per * d: (per + 1) * d].reshape(ng * d, *qkv.shape[1:])
    v = g[:, (per + 1) * d:].reshape(ng * d, *qkv.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model_cfg) -> torch.Tensor:
    """(q, k, v) in HF layout -> Megatron grouped ``linear_qkv`` rows."""
    np_, ng, per, d = _dims(model_cfg)
    if q.shape[0] != np_ * d or k.shape[0] != ng * d or v.shape[0] != ng * d:
        raise ValueError(f"q/k/v rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]} do not match "
                         f"np*d={np_ * d}, ng*d={ng * d}")
    rest = q.shape[1:]
    qkv = torch.cat([q.reshape(ng, per * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return qkv.reshape(ng * (per + 2) * d, *rest).contiguous()


def megatron_to_hf(sd: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state dict (``_extra_state`` entries ignored) -> HF-Llama names and layout."""
    sd = {k: v for k, v in sd.items() if not k.endswith(EXTRA_STATE_SUFFIX)}
    expected = set(megatron_param_names(model_cfg.num_layers))
    if set(sd) != expected:
        raise KeyError(f"megatron state dict keys differ: missing {sorted(expected - set(sd))}, "
                       f"unexpected {sorted(set(sd) - expected)}")
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"].contiguous()}
    ffn = model_cfg.ffn_hidden_size
    for i in range(model_cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"].contiguous()
        q, k, v = split_qkv(sd[m + "self_attention.linear_qkv.weight"], model_cfg)
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"].contiguous()
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"].contiguous()
        fc1 = sd[m + "mlp.linear_fc1.weight"]
        if fc1.shape[0] != 2 * ffn:
            raise ValueError(f"{m}mlp.linear_fc1.weight has {fc1.shape[0]} rows, expected 2*ffn = {2 * ffn}")
        out[h + "mlp.gate_proj.weight"] = fc1[:ffn].contiguous()
        out[h + "mlp.up_proj.weight"] = fc1[ffn:].contiguous()
        out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"].contiguous()
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"].contiguous()
    out["lm_head.weight"] = sd["output_layer.weight"].contiguous()
    return out


def hf_to_megatron(sd: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """HF-Llama state dict -> Megatron GPTModel parameter names and layout (no ``_extra_state`` entries)."""
    from forgetrain.engine import hf_param_names

    expected = set(hf_param_names(model_cfg.num_layers))
    if set(sd) != expected:
        raise KeyError(f"HF state dict keys differ: missing {sorted(expected - set(sd))}, "
                       f"unexpected {sorted(set(sd) - expected)}")
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"].contiguous()}
    for i in range(model_cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"].contiguous()
        out[m + "self_attention.linear_qkv.weight"] = merge_qkv(
            sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"], sd[h + "self_attn.v_proj.weight"],
            model_cfg)
        out[m + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"].contiguous()
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"].contiguous()
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0).contiguous()
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"].contiguous()
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].contiguous()
    out["output_layer.weight"] = sd["lm_head.weight"].contiguous()
    return out
