"""Reference Mixture-of-Experts FFN: router, fused experts, auxiliary losses, router statistics.

Layout (DESIGN §4, the Qwen3-MoE / Mixtral layout of transformers 5, so that AutoEP and
transformers' sparse block can take the same weights)::

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from smelt_ds.model.grouped_gemm import grouped_linear
from smelt_ds.model.ranges import named_range

__all__ = ["RouterOutput", "TopKRouter", "GroupedExperts", "MoE", "SwiGLU",
           "load_balancing_loss", "router_z_loss", "has_grouped_mm", "topk_lowest_index"]


def has_grouped_mm() -> bool:
    """Whether the installed torch has ``torch._grouped_mm`` (torch >= 2.8)."""
    return hasattr(torch, "_grouped_mm")


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN ``down(silu(gate(x)) * up(x))``; x: ``(..., H)`` -> ``(..., H)``."""

    def __init__(self, hidden_size: int, ffn_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------


def _expert_counts(idx_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Copies per expert, ``(N,)`` int64 expert ids -> ``(E,)`` int64. ``torch.bincount`` with a
    fixed size: its output length depends on the values, which splits a compiled graph."""
    return torch.zeros(num_experts, dtype=torch.int64, device=idx_N.device).scatter_add_(
        0, idx_N, torch.ones_like(idx_N))


def load_balancing_loss(probs_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Switch-style load-balancing loss for top-k routing (Fedus et al. 2021, eq. 4).

    ``aux = E * sum_e f_e * P_e`` with ``f_e`` the share of the T*K routed copies sent to expert e
    and ``P_e`` the mean router probability of e over tokens. Equals 1.0 under perfectly uniform
    routing. ``probs_TE`` must be a distribution over experts per token (softmax scores, or
    sigmoid scores divided by their sum).
    """
    T, E = probs_TE.shape
    counts_E = _expert_counts(topk_idx_TK.reshape(-1), E).to(probs_TE.dtype)
    f_E = counts_E / topk_idx_TK.numel()
    P_E = probs_TE.mean(dim=0)
    return E * torch.sum(f_E * P_E)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_t (logsumexp_e logits_te)^2`` (Zoph et al. 2022, ST-MoE eq. 5)."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------


@dataclass
class RouterOutput:
    """What the router decided for T tokens."""

    logits_TE: torch.Tensor  # raw router logits, fp32
    probs_TE: torch.Tensor  # distribution over experts (for the aux loss)
    topk_idx_TK: torch.Tensor  # chosen experts, int64
    topk_weight_TK: torch.Tensor  # combine weights, in the input dtype


def topk_lowest_index(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores of every row, ``(T, E)`` -> ``(T, K)`` int64, in
    descending score order; among exactly equal scores the lowest expert index comes first.

    ``torch.topk`` leaves the order of equal values unspecified (it may differ between devices,
    kernels and input sizes), so the scores are made unique first: each fp32 score is mapped to
    its order-preserving integer (the IEEE-754 bits, negative values' magnitude bits flipped; -0.0
    counted as +0.0) and widened to ``key = int << 32 | (E - 1 - e)``, so that equal scores rank
    by lowest index. ``torch.topk`` of these distinct int64 keys has one answer on every device,
    and it is a stable descending sort's first k (what this function computed before, at the cost
    of sorting all E scores). Where no scores tie, the result is ``torch.topk``'s (same indices,
    same order). Branch-free (no data-dependent Python), so it compiles into one graph. fp16 /
    bf16 scores are ranked in fp32 (exact); fp64 scores by a stable sort. The result owns its
    ``(T, K)`` storage. Raises ValueError unless ``1 <= k <= E``.
    """
    E = scores_TE.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"top-k needs 1 <= k <= number of experts: got k={k} for {E} experts")
    if scores_TE.dtype == torch.float64:
        return scores_TE.sort(dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    bits_TE = (scores_TE.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered_TE = bits_TE ^ ((bits_TE >> 31) & 0x7FFFFFFF)  # signed int order == float order
    rank_E = torch.arange(E - 1, -1, -1, device=scores_TE.device, dtype=torch.int64)
    key_TE = (ordered_TE.to(torch.int64) << 32) | rank_E
    return key_TE.topk(k, dim=-1).indices


class TopKRouter(nn.Module):
    """Softmax or sigmoid top-k router with optional aux-loss-free expert bias.

    The bias (DeepSeek-V3, arXiv 2412.19437 §2.1.2) only affects *which* experts are selected; the
    combine weights use the unbiased scores. It is a buffer updated outside autograd by
    :meth:`update_bias` from the tokens-per-expert counts accumulated since the last update.

    Ties: experts whose selection scores are exactly equal are chosen lowest expert index first
    (:func:`topk_lowest_index`), deterministically on CPU and CUDA. A zero-initialised gate, for
    example, gives every token experts ``0 .. K-1``, and an activation-checkpoint recompute
    chooses the experts its forward chose, so checkpointing leaves the gradients unchanged.
    """

    expert_bias: torch.Tensor  # buffers (register_buffer)
    tokens_per_expert: torch.Tensor

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 norm_topk_prob: bool = True, aux_loss_free_bias: bool = False, jitter: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob, self.jitter = score_func, norm_topk_prob, jitter
        self.use_bias = aux_loss_free_bias
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=aux_loss_free_bias)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x_TH: torch.Tensor, count_tokens: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x_TH`` -> ``(logits_TE, probs_TE, topk_idx_TK, topk_weight_TK)`` (the fields of
        :class:`RouterOutput`; a plain tuple so that ZeRO-3's module hooks see the tensors).

        ``count_tokens``: whether the choice adds to ``tokens_per_expert`` (with the expert bias
        on); None = when grad is enabled. The looping block manager's visit context says False
        for an activation-checkpoint recompute (it would count the tokens twice) and True for the
        first forward of a checkpointed visit (which a reentrant checkpoint runs without grad)."""
        if self.training and self.jitter > 0:
            noise = torch.empty_like(x_TH).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            x_TH = x_TH * noise
        logits_TE = F.linear(x_TH, self.weight).float()
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        select_TE = scores_TE + self.expert_bias if self.use_bias else scores_TE
        topk_idx_TK = topk_lowest_index(select_TE, self.top_k)
        weight_TK = scores_TE.gather(-1, topk_idx_TK)
        if self.norm_topk_prob:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        if count_tokens is None:
            count_tokens = torch.is_grad_enabled()
        if self.use_bias and count_tokens:
            with torch.no_grad():
                self.tokens_per_expert += _expert_counts(topk_idx_TK.reshape(-1), self.num_experts)
        return logits_TE, probs_TE, topk_idx_TK, weight_TK.to(x_TH.dtype)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """``bias_e += rate * sign(mean_load - load_e)``; resets the accumulated counts."""
        load_E = self.tokens_per_expert
        if load_E.sum() > 0:
            self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()


# ---------------------------------------------------------------------------------------------
# experts
# ---------------------------------------------------------------------------------------------


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward rejects expanded (stride 0) gradients, e.g. from .sum().
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class _SwiGLUActivation(torch.autograd.Function):
    """``silu(gate) * up`` of the fused projection ``h_N2F = [gate | up]`` -> ``(N, F)``.

    Saves only ``h_N2F`` (autograd would also keep ``silu(gate)``, ``N F`` more) and recomputes
    ``silu`` in backward (on a contiguous copy of the gate half there: torch's CPU silu runs about
    3x faster on contiguous rows). The ``(N, 2F)`` gradient is contiguous, as
    ``torch._grouped_mm``'s backward needs:
    ``d gate = g * up * silu'(gate)`` (``aten.silu_backward``), ``d up = g * silu(gate)``.
    """

    @staticmethod
    def forward(ctx, h_N2F: torch.Tensor) -> torch.Tensor:
        F_ = h_N2F.shape[-1] // 2
        # silu of the strided gate half, as autograd's path and the standalone modeling_smelt.py
        # compute it (a contiguous copy would run torch's vectorised silu, about 3x faster on
        # CPU, but its exp differs in the last bit and the logits parity tests are at 1e-6)
        a_NF = F.silu(h_N2F[:, :F_])
        ctx.save_for_backward(h_N2F)
        return a_NF.mul_(h_N2F[:, F_:])

    @staticmethod
    def backward(ctx, g_NF: torch.Tensor) -> torch.Tensor:
        (h_N2F,) = ctx.saved_tensors
        F_ = h_N2F.shape[-1] // 2
        gate_NF, up_NF = h_N2F[:, :F_].contiguous(), h_N2F[:, F_:]
        d_gate = torch.ops.aten.silu_backward(g_NF * up_NF, gate_NF)
        d_up = F.silu(gate_NF).mul_(g_NF)
        return torch.cat([d_gate, d_up], dim=-1)


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


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as two 3-D tensors; computes sorted token copies group by group.

    ``forward(x_NH, counts_E)``: ``x_NH`` rows sorted by expert, ``counts_E`` rows per expert
    (int64, sums to N); returns ``(N, H)``. The grouped path has no data-dependent Python (it
    compiles into one graph); the loop path reads ``counts_E`` on the host.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.auto = impl == "auto"
        if impl == "auto":
            impl = "grouped_mm" if has_grouped_mm() else "loop"
        if impl == "grouped_mm" and not has_grouped_mm():
            raise RuntimeError("moe.expert_impl 'grouped_mm' needs torch._grouped_mm (torch >= 2.8); "
                               "use expert_impl 'loop' or 'auto'")
        self.impl = impl

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self.impl == "grouped_mm" and self._grouped_mm_fits(x_NH):
            return self._forward_grouped(x_NH, counts_E)
        return self._forward_loop(x_NH, counts_E)

    def _grouped_mm_fits(self, x_NH: torch.Tensor) -> bool:
        """torch._grouped_mm needs row strides that are multiples of 16 bytes (H and F); 'auto'
        falls back to the loop otherwise, an explicit 'grouped_mm' says why it cannot run."""
        size = x_NH.element_size()
        if (self.hidden_dim * size) % 16 == 0 and (self.intermediate_dim * size) % 16 == 0:
            return True
        if self.auto:
            return False
        raise RuntimeError(f"moe.expert_impl 'grouped_mm' needs hidden_size ({self.hidden_dim}) and "
                           f"expert_ffn_size ({self.intermediate_dim}) times {size} bytes to be multiples of "
                           "16 bytes; use expert_impl 'auto' or 'loop', or round the sizes")

    def _forward_grouped(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offs_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
        h_N2F = grouped_linear(x_NH, self.gate_up_proj, offs_E)
        a_NF = _SwiGLUActivation.apply(h_N2F)
        out_NH = grouped_linear(a_NF, self.down_proj, offs_E)
        return _contiguous_grad(out_NH)

    def _forward_loop(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        # unbind, not self.gate_up_proj[e]: indexing a parameter E times makes backward allocate
        # and fill E full-size [E, 2F, H] gradients; unbind's backward stacks once.
        outs = []
        for x_nH, w_2FH, w_HF in zip(torch.split(x_NH, counts_E.tolist(), dim=0),
                                     self.gate_up_proj.unbind(0), self.down_proj.unbind(0)):
            gate_nF, up_nF = F.linear(x_nH, w_2FH).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_nF) * up_nF, w_HF))
        return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------------------------------
# the MoE FFN
# ---------------------------------------------------------------------------------------------


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
    def from_config(cls, hidden_size: int, moe_cfg) -> "MoE":
        return cls(hidden_size, moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.expert_ffn_size,
                   moe_cfg.shared_expert_ffn_size, moe_cfg.score_func, moe_cfg.norm_topk_prob,
                   moe_cfg.aux_loss_free_bias, moe_cfg.router_jitter, moe_cfg.expert_impl)

    def forward(self, x_BSH: torch.Tensor, count_tokens: bool | None = None, return_route: bool = False):
        """``count_tokens``: passed to the router (:meth:`TopKRouter.forward`). Returns ``(B, S, H)``;
        with ``return_route`` the tuple ``(out_BSH, route, losses)``: ``route`` the fields of
        :class:`RouterOutput` as a plain tuple, ``losses`` ``{"aux", "z"}`` -- what a compiled
        caller needs, since a traced graph should not rely on ``last_route`` / ``last_losses``
        (attributes set as side effects).

        Stages: route -> :meth:`dispatch` -> gather the copies (``index_select``) -> experts ->
        weighted K-sum per token; gather and combine have
        hand-written backwards without scatter-adds (``_GatherCopies``, ``_CombineCopies``). While a
        profiler records, the stages are the named ranges ``moe route``, ``moe dispatch`` (sort and
        gather), ``moe experts`` and ``moe combine`` (K-sum and shared expert) of
        :mod:`smelt_ds.model.ranges`."""
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(B * S, H)
        with named_range("moe route"):  # profiler ranges (smelt_ds.model.ranges; off: a flag check)
            route = RouterOutput(*self.gate(x_TH, count_tokens))
        K = route.topk_idx_TK.shape[1]
        with named_range("moe dispatch"):
            order_N, counts_E, token_N = self.dispatch(route.topk_idx_TK)
            inv_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.shape[0], device=order_N.device))
            x_NH = _GatherCopies.apply(x_TH, token_N, inv_N, K)
        with named_range("moe experts"):
            y_NH = self.experts(x_NH, counts_E)
        with named_range("moe combine"):
            out_TH = _CombineCopies.apply(y_NH, route.topk_weight_TK, inv_N, order_N)
            if self.shared_expert is not None:
                assert self.shared_expert_gate is not None  # built together with shared_expert
                out_TH = out_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        T, E = route.probs_TE.shape
        aux = E * torch.sum(counts_E.to(route.probs_TE.dtype) / (T * K) * route.probs_TE.mean(dim=0))
        losses = {"aux": aux,  # = load_balancing_loss(probs, topk_idx), from the dispatch counts
                  "z": router_z_loss(route.logits_TE)}
        self.last_route, self.last_losses = route, losses
        if return_route:
            return out_TH.reshape(B, S, H), (route.logits_TE, route.probs_TE, route.topk_idx_TK,
                                             route.topk_weight_TK), losses
        return out_TH.reshape(B, S, H)

    def dispatch(self, topk_idx_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sort the N = T*K routed copies by expert.

        Returns ``order_N`` (positions in the flattened ``(T, K)`` assignment, stable by expert),
        ``counts_E`` (copies per expert, a fixed-size count: no data-dependent shape) and
        ``token_N`` (source token of each sorted copy).
        """
        flat_N = topk_idx_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)
        counts_E = _expert_counts(flat_N, self.num_experts)
        token_N = order_N // topk_idx_TK.shape[1]
        return order_N, counts_E, token_N
