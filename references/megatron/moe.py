"""The reference's mixture-of-experts pieces (``model.num_experts``): Megatron-core 0.16.1's MoE settings, the
routing statistics each step records, and the names its MoE code needs bound without Transformer Engine."""

from __future__ import annotations

import contextlib

import torch


def define_missing_te_names() -> None:
    """megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` (and the fused MoE kernels) from Transformer
    Engine inside a ``try`` whose ``except ImportError`` binds none of them, and ``RouterGatingLinearFunction``
    then tests ``te_general_gemm is not None``: without TE the router raises NameError. Binding the missing names
    to None is what that test expects without TE, so the router takes its own ``torch.mm`` path (and the fused
    kernels stay off: ``moe_permute_fusion`` / ``moe_router_fusion`` are False). Nothing else changes."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        return
    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def moe_config(m) -> dict:
    """The TransformerConfig fields of a mixture of experts (``m``: the ModelConfig, ``m.num_experts`` set), else
    none: Megatron's SequentialMLP experts (no grouped GEMM), the allgather token dispatcher, the top-k softmax
    router (softmax over the top-k logits, ``moe_router_pre_softmax=False``), dropless (no capacity factor), no
    shared expert, and the load-balancing loss ``moe_router_load_balancing_type`` weighted by
    ``moe_aux_loss_coeff``."""
    if m.num_experts is None:
        return {}
    return dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                moe_ffn_hidden_size=m.expert_ffn_hidden_size, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                moe_router_load_balancing_type=m.moe_router_load_balancing_type,
                moe_router_score_function=m.moe_router_score_function, moe_router_pre_softmax=False,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_expert_capacity_factor=None,
                moe_shared_expert_intermediate_size=None, moe_permute_fusion=False, moe_router_fusion=False,
                moe_router_dtype=None, moe_z_loss_coeff=None, moe_input_jitter_eps=None)


@contextlib.contextmanager
def moe_stats(gpt, m, n_micro: int):
    """For a mixture of experts, the step's routing statistics (``StepResult.extra``), filled in on exit:
    ``moe_tokens_per_expert`` ``[L][E]`` ints, each layer's ``tokens_per_expert`` as its SequentialMLP receives
    them (a forward pre-hook), summed over the micro-batches; ``moe_load_balancing_loss`` ``[L]`` floats (with
    ``moe_aux_loss_coeff > 0``), Megatron's aux-losses tracker (``moe_utils.save_to_aux_losses_tracker``: per
    layer the sum over micro-batches of aux_loss / coeff, fp32) divided by the micro-batch count in fp32, then
    cleared. Yields the dict; empty for a dense model."""
    extra: dict = {}
    if m.num_experts is None:
        yield extra
        return
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    counts = [torch.zeros(m.num_experts, dtype=torch.long) for _ in gpt.decoder.layers]

    def hook(i):
        def pre(_module, args):
            counts[i].add_(args[1].to("cpu", torch.long))
        return pre

    clear_aux_losses_tracker()
    handles = [layer.mlp.experts.register_forward_pre_hook(hook(i))
               for i, layer in enumerate(gpt.decoder.layers)]
    try:
        yield extra
    finally:
        for h in handles:
            h.remove()
    extra["moe_tokens_per_expert"] = [c.tolist() for c in counts]
    tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if tracked is not None and tracked.get("values") is not None:
        extra["moe_load_balancing_loss"] = (tracked["values"].detach().float().cpu() / n_micro).tolist()
    clear_aux_losses_tracker()
