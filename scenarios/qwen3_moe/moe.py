"""The mixture-of-experts MLP, written from scratch as the op-by-op mirror of megatron-core 0.16.1's ``MoELayer``
with a ``TopKRouter`` (softmax scores, ``moe_router_pre_softmax=False``), the allgather token dispatcher
(``MoEAllGatherTokenDispatcher``) at TP = EP = 1 and ``SequentialMLP`` experts, dropless (no capacity factor),
no shared expert, no fused kernels (no Transformer Engine).

Shapes: s sequence, b micro-batch, h hidden, T = s*b tokens, E experts, k = top-k, f_e each expert's SwiGLU width.

Forward of one layer's MLP, ``x [s, b, h] -> [s, b, h]`` (source of each step in brackets):

1. logits ``[T, E]`` = ``x.view(T, h) @ W_router^T`` in the input's dtype (``moe_utils.RouterGatingLinearFunction``
   without TE: ``torch.mm``; its backward is two ``torch.mm`` as well).
2. top-k of the logits, then softmax over the k selected logits in fp32, cast back (``moe_utils.
   topk_routing_with_score_function``, score_function softmax, no pre-softmax: Qwen3-MoE's ``norm_topk_prob``); the
   ``[T, E]`` probabilities and the bool routing map are scattered from the top-k indices (``index_put_`` under
   torch's deterministic algorithms, ``scatter`` otherwise, as Megatron chooses).
3. training only (``self.training`` and grad enabled, ``moe_aux_loss_coeff > 0``, balancing type ``aux_loss``):
   the Switch-Transformer load-balancing loss (``moe_utils.compute_routing_scores_for_aux_loss`` and
   ``switch_load_balancing_loss_func``): scores = softmax(logits) over all E in fp32, its own top-k map, tokens per
   expert f = map.sum(0), ``aux = sum(scores.sum(0) * f) * (E * coeff / (k * T * T))``. It is attached to the
   ``[T, E]`` probabilities by :class:`AuxLossAttach` (``moe_utils.MoEAuxLossAutoScaler``): identity forward; in
   the backward the aux loss receives the gradient ``ones * scale``, scale = 1 / (number of micro-batches) in fp32
   (``schedules.forward_step_calc_loss``: ``grad_scale_func(ones(1)) * cp_size / num_microbatches``, the loss scale
   being 1 without fp16).
4. permutation by expert (``token_dispatcher.MoEAllGatherTokenDispatcher.dispatch_postprocess`` and
   ``moe_utils.permute``): ``sorted_indices`` = the token ids of expert 0 in token order, then expert 1's, ...
   (``masked_select`` of the transposed map); the tokens ``index_select``-ed, their probabilities
   ``masked_select``-ed from the transposed ``[E, T]`` probabilities.
5. experts in expert order (``experts.SequentialMLP``: ``torch.split`` by tokens per expert, each ``MLP`` with
   ``per_token_scale``, ``torch.cat``): ``fc1 -> chunk -> silu(gate) * (up + 0.0)`` (``glu_linear_offset``), times
   the token's probability (cast back to the activation's dtype), ``fc2``.
6. un-permutation (``moe_utils.unpermute`` without probabilities): a zero ``[T, h]`` tensor accumulates each
   permuted row at its token, ``index_add_`` under deterministic algorithms, ``scatter_add_`` otherwise, in the
   permuted order (expert 0's rows first), then viewed back to ``[s, b, h]``.

Each layer records, per forward, its tokens per expert (``[E]`` int64, from the routing map) and, with the aux loss,
``aux / coeff`` (Megatron's aux-losses tracker value) in :attr:`MoE.stats`, which the engine reads and clears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._llama.model import linear

GLU_LINEAR_OFFSET = 0.0  # Megatron's TransformerConfig.glu_linear_offset default, added to the up half


class _RouterGating(torch.autograd.Function):
    """``logits = x.view(-1, h) @ W^T`` in ``router_dtype``, viewed back to ``x``'s leading dims; backward
    ``dx = dy @ W``, ``dW = dy^T @ x`` on the 2-D views, cast to the input's / weight's dtype (megatron-core 0.16.1
    ``moe_utils.RouterGatingLinearFunction``, the ``torch.mm`` path taken without Transformer Engine)."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.router_dtype, ctx.input_dtype, ctx.weight_dtype = router_dtype, inp.dtype, weight.dtype
        shape = inp.shape
        out = torch.mm(inp.view(-1, shape[-1]).to(router_dtype), weight.to(router_dtype).t())
        return out.view(*shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, weight = ctx.saved_tensors
        shape = inp.shape
        inp2 = inp.view(-1, shape[-1])
        g2 = grad_output.view(-1, grad_output.shape[-1])
        grad_input = torch.mm(g2, weight.to(ctx.router_dtype)).to(ctx.input_dtype)
        grad_weight = torch.mm(g2.t(), inp2.to(ctx.router_dtype)).to(ctx.weight_dtype)
        return grad_input.view(*shape), grad_weight, None


class AuxLossAttach(torch.autograd.Function):
    """Identity on ``output``; its backward hands ``aux_loss`` the gradient ``ones_like(aux_loss) * scale``
    (megatron-core 0.16.1 ``moe_utils.MoEAuxLossAutoScaler``; ``scale``: fp32 ``[1]``, 1 / micro-batches)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale, None


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, a 0-d tensor: ``sum(scores.sum(0) * tokens_per_expert) *
    (E * coeff / (topk * T * T))``, the Python scalar formed in float64 first (megatron-core 0.16.1
    ``moe_utils.switch_load_balancing_loss_func``, unfused). ``scores`` fp32 ``[T, E]`` (softmax over all experts),
    ``tokens_per_expert`` int64 ``[E]``."""
    aggregated = scores.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def topk_softmax_routing(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (probabilities ``[T, E]`` in the logits' dtype, zero off the top-k; routing map bool
    ``[T, E]``): softmax in fp32 over the k largest logits of each token, ties resolved by ``torch.topk``
    (megatron-core 0.16.1 ``moe_utils.topk_routing_with_score_function``, softmax, ``use_pre_softmax=False``, no
    groups, no scaling factor, no expert bias)."""
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)  # [T, k]
    # one-hot [T, k, E] of the chosen experts: each [T, E] entry sums one chosen value with zeros, so it is that
    # value exactly (and its gradient flows back to the one probability that chose it)
    chosen = torch.nn.functional.one_hot(top_indices, num_classes=logits.shape[1])
    routing_map = chosen.sum(dim=1).bool()
    routing_probs = (chosen.to(probs.dtype) * probs.unsqueeze(-1)).sum(dim=1)
    return routing_probs, routing_map


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [T, h]``, bool ``routing_map [T, E]`` -> (the tokens grouped by expert ``[sum(map), h]``,
    ``sorted_indices`` int64: expert 0's token ids in token order, then expert 1's, ...) (megatron-core 0.16.1
    ``moe_utils.permute``, unfused, no drop-and-pad)."""
    # nonzero() walks the [E, T] view in row-major order: expert by expert, each expert's tokens in token order
    sorted_indices = routing_map.bool().t().nonzero(as_tuple=True)[1]
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, restore_shape) -> torch.Tensor:
    """Rows of ``permuted [N, h]`` summed into a zero ``restore_shape`` ``[T, h]`` tensor at ``sorted_indices``,
    in permuted order (``index_add_`` under deterministic algorithms, ``scatter_add_`` otherwise; megatron-core
    0.16.1 ``moe_utils.unpermute`` without probabilities, unfused). With top-k > 2 a token's k addends are summed
    in expert order, so another order changes the last bits."""
    out = torch.zeros(restore_shape, dtype=permuted.dtype, device=permuted.device)
    if torch.are_deterministic_algorithms_enabled():
        out.index_add_(0, sorted_indices, permuted)
    else:
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, restore_shape[-1]), permuted)
    return out.to(dtype=permuted.dtype)


class Expert(nn.Module):
    """One SwiGLU expert: ``fc1 [2 f_e, h]`` (``[gate; up]``), ``fc2 [h, f_e]``. ``forward(x [n, h], probs [n])
    -> [n, h]``: ``fc2((silu(gate) * (up + 0.0)) * probs)`` (megatron-core 0.16.1 ``mlp.MLP.forward`` with
    ``per_token_scale``, unfused)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(2 * f, h))
        self.fc2 = nn.Parameter(torch.empty(h, f))

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(linear(x, self.fc1), 2, dim=-1)
        inter = F.silu(gate) * (up + GLU_LINEAR_OFFSET)
        inter = (inter * probs.unsqueeze(-1)).to(inter.dtype)
        return linear(inter, self.fc2)


class MoE(nn.Module):
    """One layer's mixture of experts, ``x [s, b, h] -> [s, b, h]`` (module doc: the steps and their sources).

    Parameters: ``router [E, h]``, then ``experts.{e}.fc1`` / ``fc2`` (Megatron registers the router first).
    ``aux_scale``: fp32 ``[1]`` tensor, the aux loss's backward scale (the engine sets 1 / micro-batches).
    ``stats``: per forward, ``(tokens_per_expert [E] int64, aux_loss / coeff or None)``."""

    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.coeff = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.expert_ffn_hidden_size)
                                     for _ in range(cfg.num_experts))
        self.aux_scale = torch.ones(1)
        self.stats: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        num_experts, topk = self.num_experts, self.topk
        logits = _RouterGating.apply(x, self.router, x.dtype)  # [s, b, E]
        logits = logits.view(-1, num_experts)
        probs, routing_map = topk_softmax_routing(logits, topk)
        aux_logged = None
        if self.training and torch.is_grad_enabled() and self.coeff > 0:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            _, top_aux = torch.topk(scores, k=topk, dim=1)
            map_aux = torch.zeros_like(logits).int().scatter(1, top_aux, 1).bool()
            aux = switch_load_balancing_loss(scores, map_aux.sum(dim=0), map_aux.shape[0], topk, num_experts,
                                             self.coeff)
            aux_logged = (aux / self.coeff).detach()
            probs = AuxLossAttach.apply(probs, aux, self.aux_scale.to(aux.device))
        hidden = x.view(-1, shape[-1])  # [T, h]
        # dispatch_postprocess: every expert is local (EP = 1)
        local_map = routing_map[:, 0:num_experts].contiguous()
        local_probs = probs[:, 0:num_experts].contiguous()
        tokens_per_expert = local_map.sum(dim=0).long().cpu()
        self.stats.append((tokens_per_expert, aux_logged))
        permuted, sorted_indices = permute(hidden, local_map)
        permuted_probs = local_probs.T.contiguous().masked_select(local_map.T.contiguous())
        # SequentialMLP
        if num_experts == 1:
            out = self.experts[0](permuted, permuted_probs)
        else:
            counts = tokens_per_expert.tolist()
            outs = [expert(t, p) for expert, t, p in zip(self.experts, torch.split(permuted, counts),
                                                         torch.split(permuted_probs, counts))]
            out = torch.cat(outs, dim=0)
        return unpermute(out, sorted_indices, hidden.shape).view(shape)
