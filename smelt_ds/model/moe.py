"""The reference Mixture-of-Experts FFN: the router (:mod:`smelt_ds.model.router`), the experts
(:mod:`smelt_ds.model.experts`) and the auxiliary losses (:mod:`smelt_ds.model.losses`) composed.

Layout (the Qwen3-MoE / Mixtral layout of transformers 5, so that AutoEP and transformers' sparse
block can take the same weights; the backends that run it: docs/training.md)::

    mlp.gate.weight                 [E, H]       router, no bias
    mlp.experts.gate_up_proj        [E, 2F, H]   gate and up projections of every expert
    mlp.experts.down_proj           [E, H, F]
    mlp.shared_expert.*             optional dense SwiGLU expert run on every token
    mlp.shared_expert_gate.weight   [1, H]       its sigmoid gate

Shape legend (suffix letters, as in torchtitan's moe.py): B batch, S sequence, T = B*S tokens,
H hidden, E experts, K top-k, F expert intermediate size, N = T*K routed token copies.

The forward reads as named stages: ``route`` -> ``dispatch`` (sort token copies by expert) ->
``experts`` (grouped GEMM) -> ``combine`` (each token's weighted sum of its K expert outputs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from smelt_ds.model.experts import GroupedExperts, SwiGLU
from smelt_ds.model.losses import load_balancing_loss_from_counts, router_z_loss
from smelt_ds.model.ranges import named_range
from smelt_ds.model.router import RouterOutput, TopKRouter, expert_counts

__all__ = ["MoE", "SortedCopies"]


class SortedCopies(NamedTuple):
    """The N = T*K routed token copies in expert order (:meth:`MoE.dispatch`)."""

    x_NH: torch.Tensor  # the token vectors, copied expert by expert
    counts_E: torch.Tensor  # copies per expert, int64, sums to N (a fixed-size count: no data-dependent shape)
    order_N: torch.Tensor  # position of each sorted copy in the flattened (T, K) assignment (stable by expert)
    inv_N: torch.Tensor  # the inverse permutation: sorted position of assignment t*K + k


class MoE(nn.Module):
    """Routed experts (+ optional shared expert). ``forward(x, count_tokens=None)``: ``(B, S, H)`` ->
    ``(B, S, H)`` (``count_tokens``: see :meth:`TopKRouter.forward`).

    Per call it leaves ``self.last_route`` (the :class:`RouterOutput`) and ``self.last_losses``
    (``{"aux": tensor, "z": tensor}``, unscaled) for the looping block manager's recorder, which
    keys them by ``(layer, visit)``; nothing accumulates across calls, so an activation
    checkpoint recompute overwrites rather than double-counts.

    The forward (grouped_mm experts) branches on no tensor value, so ``torch.compile(fullgraph=
    True)`` traces it into one graph that serves every call of the same shapes.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, ffn_size: int,
                 shared_ffn_size: int = 0, score_func: str = "softmax", norm_topk_prob: bool = True,
                 aux_loss_free_bias: bool = False, jitter: float = 0.0, expert_impl: str = "auto"):
        super().__init__()
        self.num_experts, self.num_experts_per_tok = num_experts, top_k
        self.gate = TopKRouter(hidden_size, num_experts, top_k, score_func, norm_topk_prob,
                               aux_loss_free_bias, jitter)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_size, expert_impl)
        self.shared_expert = SwiGLU(hidden_size, shared_ffn_size) if shared_ffn_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_ffn_size else None
        self.last_route: RouterOutput | None = None
        self.last_losses: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, hidden_size: int, moe_cfg) -> MoE:
        return cls(hidden_size, moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.expert_ffn_size,
                   moe_cfg.shared_expert_ffn_size, moe_cfg.score_func, moe_cfg.norm_topk_prob,
                   moe_cfg.aux_loss_free_bias, moe_cfg.router_jitter, moe_cfg.expert_impl)

    def forward(self, x_BSH: torch.Tensor, count_tokens: bool | None = None, return_route: bool = False):
        """``count_tokens``: passed to the router (:meth:`TopKRouter.forward`). Returns ``(B, S, H)``;
        with ``return_route`` the tuple ``(out_BSH, route, losses)``: ``route`` the fields of
        :class:`RouterOutput` as a plain tuple, ``losses`` ``{"aux", "z"}`` -- what a compiled
        caller needs, since a traced graph should not rely on ``last_route`` / ``last_losses``
        (attributes set as side effects).

        Stages: route (the router) -> :meth:`dispatch` (sort the copies by expert, gather them) ->
        experts -> :meth:`combine` (weighted K-sum per token, shared expert); gather and combine have
        hand-written backwards without scatter-adds (``_GatherCopies``, ``_CombineCopies``). While a
        profiler records, the stages are the named ranges ``moe route``, ``moe dispatch``,
        ``moe experts`` and ``moe combine`` of :mod:`smelt_ds.model.ranges`."""
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(B * S, H)
        with named_range("moe route"):  # profiler ranges (smelt_ds.model.ranges; off: a flag check)
            route = RouterOutput(*self.gate(x_TH, count_tokens))
        with named_range("moe dispatch"):
            copies = self.dispatch(x_TH, route.topk_idx_TK)
        with named_range("moe experts"):
            y_NH = self.experts(copies.x_NH, copies.counts_E)
        with named_range("moe combine"):
            out_TH = self.combine(x_TH, y_NH, route.topk_weight_TK, copies)
        losses = {"aux": load_balancing_loss_from_counts(route.probs_TE, copies.counts_E, route.topk_idx_TK.shape[1]),
                  "z": router_z_loss(route.logits_TE)}
        self.last_route, self.last_losses = route, losses
        if return_route:
            return out_TH.reshape(B, S, H), (route.logits_TE, route.probs_TE, route.topk_idx_TK,
                                             route.topk_weight_TK), losses
        return out_TH.reshape(B, S, H)

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> SortedCopies:
        """Sort the N = T*K routed copies by expert (stable) and gather their token vectors."""
        K = topk_idx_TK.shape[1]
        flat_N = topk_idx_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)
        counts_E = expert_counts(flat_N, self.num_experts)
        token_N = order_N // K
        inv_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.shape[0], device=order_N.device))
        return SortedCopies(_GatherCopies.apply(x_TH, token_N, inv_N, K), counts_E, order_N, inv_N)

    def combine(self, x_TH: torch.Tensor, y_NH: torch.Tensor, weight_TK: torch.Tensor,
                copies: SortedCopies) -> torch.Tensor:
        """Each token's sum of its K expert outputs ``y_NH`` (expert order) weighted by ``weight_TK``,
        plus the gated shared expert of ``x_TH`` when there is one; ``(T, H)``."""
        out_TH = _CombineCopies.apply(y_NH, weight_TK, copies.inv_N, copies.order_N)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built together with shared_expert
            out_TH = out_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        return out_TH


class _GatherCopies(torch.autograd.Function):
    """Token copies in expert order: ``x_TH`` -> ``x_NH = x_TH[token_N]`` (``index_select``).

    Every token has exactly K copies (top-k experts are distinct), so the backward sums them as a
    permutation and a K-sum, ``g_TH = g_NH[inv_N].view(T, K, H).sum(1)`` (``inv_N`` the inverse
    of the dispatch order), instead of autograd's serial ``index_add`` scatter."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, token_N: torch.Tensor, inv_N: torch.Tensor,
                top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inv_N)
        ctx.top_k = top_k
        return x_TH.index_select(0, token_N)

    @staticmethod
    def backward(ctx, g_NH: torch.Tensor):
        (inv_N,) = ctx.saved_tensors
        K = ctx.top_k
        g_TH = g_NH.index_select(0, inv_N).view(inv_N.shape[0] // K, K, g_NH.shape[-1]).sum(1)
        return g_TH, None, None, None


class _CombineCopies(torch.autograd.Function):
    """Weighted sum of each token's K expert outputs: ``y_NH`` (expert order), ``w_TK`` ->
    ``out_TH[t] = sum_k w_TK[t, k] * y_NH[inv_N[t K + k]]``.

    Backward: ``d w_TK[t, k] = <g_TH[t], y_TKH[t, k]>``, ``d y_TKH = w_TK (x) g_TH`` brought back
    to expert order with ``order_N`` (the inverse permutation of ``inv_N``): two gathers and
    elementwise work, no scatter-add."""

    @staticmethod
    def forward(ctx, y_NH: torch.Tensor, w_TK: torch.Tensor, inv_N: torch.Tensor,
                order_N: torch.Tensor) -> torch.Tensor:
        T, K = w_TK.shape
        y_TKH = y_NH.index_select(0, inv_N).view(T, K, y_NH.shape[-1])
        ctx.save_for_backward(y_TKH, w_TK, order_N)
        # products then a K-sum (not a bmm's fused multiply-adds): for K = 2 bitwise the index_add
        # scatter's result, so the standalone modeling_smelt.py (index_add) agrees to the last bit
        return (y_TKH * w_TK.to(y_TKH.dtype).unsqueeze(-1)).sum(1)

    @staticmethod
    def backward(ctx, g_TH: torch.Tensor):
        y_TKH, w_TK, order_N = ctx.saved_tensors
        g_y = g_w = None
        if ctx.needs_input_grad[0]:
            g_TKH = w_TK.to(g_TH.dtype).unsqueeze(-1) * g_TH.unsqueeze(1)
            g_y = g_TKH.view(-1, g_TH.shape[-1]).index_select(0, order_N)
        if ctx.needs_input_grad[1]:
            g_w = (y_TKH * g_TH.unsqueeze(1)).sum(-1).to(w_TK.dtype)
        return g_y, g_w, None, None
