"""The training objective: how the model's unweighted losses combine into the loss that is
backpropagated (the model returns ``lm_loss``, ``aux_loss``, ``z_loss``; it never weights them).

    loss = lm_loss + train.aux_loss_coef * aux_loss + train.z_loss_coef * z_loss

``aux_loss`` is the Switch Transformer load-balancing loss ``E * sum_e f_e P_e`` (Fedus et al.
2021, arXiv 2101.03961, eq. 4) and ``z_loss`` the router z-loss ``mean_t logsumexp(logits_t)^2``
(Zoph et al. 2022, ST-MoE, arXiv 2202.08906, eq. 5), both means over MoE *visits*
(:class:`smelt_ds.model.lm.VisitRecorder`). Without MoE layers the loss is ``lm_loss``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["total_loss"]


def total_loss(out: Any, train_cfg: Any) -> torch.Tensor:
    """``lm + aux_coef * aux + z_coef * z`` (a scalar tensor) of a :class:`smelt_ds.model.lm.LMOutput`
    computed with labels; ``train_cfg`` is a :class:`smelt_ds.config.train.TrainConfig`
    (``aux_loss_coef``, ``z_loss_coef``). ``lm_loss`` alone when the model has no MoE visit.

    Raises ValueError when ``out`` has no ``lm_loss`` (forward without labels).
    """
    if out.lm_loss is None:
        raise ValueError("total_loss needs an LMOutput computed with labels (out.lm_loss is None)")
    loss = out.lm_loss
    if out.aux_loss is not None:  # this order of operations is what the golden loss curves hold
        loss = loss + train_cfg.aux_loss_coef * out.aux_loss + train_cfg.z_loss_coef * out.z_loss
    return loss
