"""The MoE router: top-k expert choice per token, softmax or sigmoid scores, optional aux-loss-free
expert bias (DeepSeek-V3), deterministic ties (lowest expert index first).

Layout: ``mlp.gate.weight`` ``[E, H]`` (no bias), the Qwen3-MoE / Mixtral layout of transformers 5.

Shape legend (suffix letters, as in torchtitan's moe.py): B batch, S sequence, T = B*S tokens,
H hidden, E experts, K top-k, F expert intermediate size, N = T*K routed token copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RouterOutput", "TopKRouter", "topk_lowest_index", "expert_counts"]


@dataclass
class RouterOutput:
    """What the router decided for T tokens."""

    logits_TE: torch.Tensor  # raw router logits, fp32
    probs_TE: torch.Tensor  # distribution over experts (for the aux loss)
    topk_idx_TK: torch.Tensor  # chosen experts, int64
    topk_weight_TK: torch.Tensor  # combine weights, in the input dtype


def expert_counts(idx_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Copies per expert, ``(N,)`` int64 expert ids -> ``(E,)`` int64. ``torch.bincount`` with a
    fixed size: its output length depends on the values, which splits a compiled graph."""
    return torch.zeros(num_experts, dtype=torch.int64, device=idx_N.device).scatter_add_(
        0, idx_N, torch.ones_like(idx_N))


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
                self.tokens_per_expert += expert_counts(topk_idx_TK.reshape(-1), self.num_experts)
        return logits_TE, probs_TE, topk_idx_TK, weight_TK.to(x_TH.dtype)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """``bias_e += rate * sign(mean_load - load_e)``; resets the accumulated counts."""
        load_E = self.tokens_per_expert
        if load_E.sum() > 0:
            self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()
