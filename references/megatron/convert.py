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
``decoder.layers.{i}.self_attention.q_layernorm.weight`` [d]    ``...self_attn.q_norm.weight`` (``qk_layernorm``)
``decoder.layers.{i}.self_attention.k_layernorm.weight`` [d]    ``...self_attn.k_norm.weight`` (``qk_layernorm``)
``decoder.layers.{i}.mlp.router.weight``    [E, h]              ``model.layers.{i}.mlp.gate.weight`` (``num_experts``)
``...mlp.experts.local_experts.{e}.linear_fc1.weight`` [2*fe, h]  ``...mlp.experts.{e}.gate_proj.weight`` ; ``up_proj``
``...mlp.experts.local_experts.{e}.linear_fc2.weight`` [h, fe]    ``...mlp.experts.{e}.down_proj.weight``
=============================================================  ==================================================

With ``num_experts`` E (Megatron's MoELayer with SequentialMLP experts, the local spec; HF Qwen3-MoE's names) a
layer's MLP is the router and E experts of width fe = ``model.expert_ffn_hidden_size`` instead of the dense
``mlp.linear_fc1`` / ``linear_fc2``; each expert's ``linear_fc1`` is ``[gate; up]`` as the dense one.

With ``share_embeddings_and_output_weights`` the Megatron model has no ``output_layer.weight`` (the LM head uses the
embedding) and the HF layout no ``lm_head.weight`` (HF saves a tied model so); an HF dict that carries one anyway
must hold the embedding's values (HF's in-memory state dict shares the tensor).

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
    d = model_cfg.head_dim
    if np_ % ng:
        raise ValueError(f"num_query_groups={ng} does not divide num_attention_heads={np_}")
    return np_, ng, np_ // ng, d


def megatron_param_names(num_layers: int, qk_layernorm: bool = False, tied: bool = False,
                         num_experts: int | None = None) -> list[str]:
    """Megatron GPTModel parameter names (local spec) in forward order; ``qk_layernorm`` adds each layer's
    ``self_attention.{q,k}_layernorm.weight``, ``tied`` drops ``output_layer.weight``, ``num_experts`` E replaces
    the dense MLP by ``mlp.router.weight`` and E experts' ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight"]
        if qk_layernorm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "pre_mlp_layernorm.weight")
        if num_experts is None:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        else:
            names.append(p + "mlp.router.weight")
            for e in range(num_experts):
                names += [f"{p}mlp.experts.local_experts.{e}.linear_fc{j}.weight" for j in (1, 2)]
    names += ["decoder.final_layernorm.weight"] + ([] if tied else ["output_layer.weight"])
    return names


def _names(model_cfg) -> list[str]:
    return megatron_param_names(model_cfg.num_layers, model_cfg.qk_layernorm,
                                model_cfg.share_embeddings_and_output_weights, model_cfg.num_experts)


def _mlps(model_cfg, i: int) -> list[tuple[str, str, int]]:
    """Layer ``i``'s SwiGLU MLPs as (Megatron prefix, HF prefix, width): the dense MLP, or each expert."""
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if model_cfg.num_experts is None:
        return [(m, h, model_cfg.ffn_hidden_size)]
    fe = model_cfg.expert_ffn_hidden_size
    return [(f"{m}experts.local_experts.{e}.", f"{h}experts.{e}.", fe) for e in range(model_cfg.num_experts)]


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
    expected = set(_names(model_cfg))
    if set(sd) != expected:
        raise KeyError(f"megatron state dict keys differ: missing {sorted(expected - set(sd))}, "
                       f"unexpected {sorted(set(sd) - expected)}")
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"].contiguous()}
    for i in range(model_cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"].contiguous()
        q, k, v = split_qkv(sd[m + "self_attention.linear_qkv.weight"], model_cfg)
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        if model_cfg.qk_layernorm:
            out[h + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"].contiguous()
            out[h + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"].contiguous()
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"].contiguous()
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"].contiguous()
        if model_cfg.num_experts is not None:
            out[h + "mlp.gate.weight"] = sd[m + "mlp.router.weight"].contiguous()
        for mm, hm, ffn in _mlps(model_cfg, i):
            fc1 = sd[mm + "linear_fc1.weight"]
            if fc1.shape[0] != 2 * ffn:
                raise ValueError(f"{mm}linear_fc1.weight has {fc1.shape[0]} rows, expected 2*ffn = {2 * ffn}")
            out[hm + "gate_proj.weight"] = fc1[:ffn].contiguous()
            out[hm + "up_proj.weight"] = fc1[ffn:].contiguous()
            out[hm + "down_proj.weight"] = sd[mm + "linear_fc2.weight"].contiguous()
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"].contiguous()
    if not model_cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"].contiguous()
    return out


def hf_to_megatron(sd: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """HF-Llama state dict -> Megatron GPTModel parameter names and layout (no ``_extra_state`` entries). Tied: an
    ``lm_head.weight`` that is present must equal ``model.embed_tokens.weight`` and is dropped. Raises KeyError for
    missing or unexpected names, ValueError for a tied LM head that differs from the embedding."""
    from forgetrain.engine import hf_names

    if model_cfg.share_embeddings_and_output_weights and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd.get("model.embed_tokens.weight", torch.empty(0))):
            raise ValueError("share_embeddings_and_output_weights: lm_head.weight differs from "
                             "model.embed_tokens.weight (a tied model has one matrix)")
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    expected = set(hf_names(model_cfg))
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
        if model_cfg.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = sd[h + "self_attn.q_norm.weight"].contiguous()
            out[m + "self_attention.k_layernorm.weight"] = sd[h + "self_attn.k_norm.weight"].contiguous()
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"].contiguous()
        if model_cfg.num_experts is not None:
            out[m + "mlp.router.weight"] = sd[h + "mlp.gate.weight"].contiguous()
        for mm, hm, _ in _mlps(model_cfg, i):
            out[mm + "linear_fc1.weight"] = torch.cat(
                [sd[hm + "gate_proj.weight"], sd[hm + "up_proj.weight"]], dim=0).contiguous()
            out[mm + "linear_fc2.weight"] = sd[hm + "down_proj.weight"].contiguous()
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].contiguous()
    if not model_cfg.share_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"].contiguous()
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallelism: Megatron's per-rank shards <-> the full (TP=1) Megatron tensors. Pure slicing and
# concatenation, no arithmetic. Megatron partitions each TP-parallel weight into TP contiguous chunks of its
# ``partition_dim`` (``_initialize_affine_weight_cpu`` with stride 1; ``VocabUtility`` for the vocabulary):
#
#   embedding.word_embeddings.weight  [V/tp, h]        rows: vocab ids [r*V/tp, (r+1)*V/tp)   (VocabParallelEmbedding)
#   output_layer.weight               [V/tp, h]        rows, as above                          (ColumnParallelLinear)
#   self_attention.linear_qkv.weight  [ng/tp*(np/ng+2)*d, h]  rows: query groups [r*ng/tp, (r+1)*ng/tp) with
#                                                      their q/k/v rows in the grouped order   (ColumnParallelLinear)
#   self_attention.linear_proj.weight [h, np/tp*d]     columns: heads [r*np/tp, (r+1)*np/tp)  (RowParallelLinear)
#   mlp.linear_fc1.weight             [2*ffn/tp, h]    [gate_r; up_r]: rank r's chunk of gate, then its chunk of
#                                                      up (the local output is chunk(2)-ed into act(x0) * x1)
#   mlp.linear_fc2.weight             [h, ffn/tp]      columns                                 (RowParallelLinear)
#   *layernorm.weight                 [h]              replicated on every TP rank
# ----------------------------------------------------------------------------------------------------------------


def tp_partition(name: str):
    """How Megatron param ``name`` is split over TP ranks: 0 / 1 (that dim, contiguous chunks), ``"glu"``
    (``linear_fc1``: gate and up halves chunked separately) or None (replicated)."""
    if name.endswith(("layernorm.weight", "mlp.router.weight")):  # norms ([h]; q/k_layernorm [d]), the MoE router
        return None
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight")) or name == "output_layer.weight":
        return 0
    raise KeyError(f"no tensor-parallel partitioning known for {name}")


def tp_split(name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The full (TP=1) Megatron tensor -> rank ``tp_rank``'s shard (contiguous copy). Raises ValueError when the
    partitioned dim is not divisible by ``tp_size``."""
    part = tp_partition(name)
    if part is None or tp_size == 1:
        return full.contiguous()
    if part == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([tp_split("x.linear_qkv.weight", gate, tp_size, tp_rank),
                          tp_split("x.linear_qkv.weight", up, tp_size, tp_rank)], dim=0).contiguous()
    if full.shape[part] % tp_size:
        raise ValueError(f"{name}: dim {part} of size {full.shape[part]} is not divisible by TP={tp_size}")
    return full.chunk(tp_size, dim=part)[tp_rank].contiguous()


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Every TP rank's shard (in TP-rank order) -> the full (TP=1) Megatron tensor; inverse of :func:`tp_split`.
    A replicated tensor returns rank 0's copy."""
    part = tp_partition(name)
    if part is None or len(shards) == 1:
        return shards[0].contiguous()
    if part == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]).contiguous()
    return torch.cat(shards, dim=part).contiguous()
