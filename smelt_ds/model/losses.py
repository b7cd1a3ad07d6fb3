"""The MoE auxiliary losses, unweighted (the training objective weights them:
:func:`smelt_ds.train.objective.total_loss`): Switch-style load balancing and the router z-loss.

Shape legend (suffix letters, as in torchtitan's moe.py): B batch, S sequence, T = B*S tokens,
H hidden, E experts, K top-k, F expert intermediate size, N = T*K routed token copies.
"""

from __future__ import annotations

import torch

from smelt_ds.model.router import expert_counts

__all__ = ["load_balancing_loss", "load_balancing_loss_from_counts", "router_z_loss"]


def load_balancing_loss(probs_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Switch-style load-balancing loss for top-k routing (Fedus et al. 2021, eq. 4).

    ``aux = E * sum_e f_e * P_e`` with ``f_e`` the share of the T*K routed copies sent to expert e
    and ``P_e`` the mean router probability of e over tokens. Equals 1.0 under perfectly uniform
    routing. ``probs_TE`` must be a distribution over experts per token (softmax scores, or
    sigmoid scores divided by their sum).
    """
    E = probs_TE.shape[1]
    return load_balancing_loss_from_counts(probs_TE, expert_counts(topk_idx_TK.reshape(-1), E), topk_idx_TK.shape[1])


def load_balancing_loss_from_counts(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`load_balancing_loss` from the routed copies per expert ``counts_E`` (``(E,)`` int64,
    summing to T * ``top_k``), e.g. the counts the MoE layer's dispatch computed anyway."""
    T, E = probs_TE.shape
    f_E = counts_E.to(probs_TE.dtype) / (T * top_k)
    P_E = probs_TE.mean(dim=0)
    return E * torch.sum(f_E * P_E)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss ``mean_t (logsumexp_e logits_te)^2`` (Zoph et al. 2022, ST-MoE eq. 5)."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()
