"""The MoE auxiliary losses (smelt_ds/model/losses.py) on a constructed routing, by hand: the layer's
aux and z losses (softmax and sigmoid scores), the load-balancing loss at its extremes."""

from __future__ import annotations

import math

import pytest
import torch

from smelt_ds.model.losses import load_balancing_loss, router_z_loss
from tests.model.moe_helpers import BY_HAND_RTOL, TOPK, A, C, constructed_moe


def test_aux_and_z_loss_softmax_by_hand():
    moe, x = constructed_moe()
    moe(x)
    route = moe.last_route
    assert [set(r) for r in route.topk_idx_TK.tolist()] == TOPK
    # f_e: share of the 8 routed copies; P_e: mean probability
    f = [2 / 8, 3 / 8, 3 / 8]
    P = [(1 / 6 + 4 / 8 + 2 / 8 + 1 / 8) / 4, (2 / 6 + 1 / 8 + 5 / 8 + 3 / 8) / 4, (3 / 6 + 3 / 8 + 1 / 8 + 4 / 8) / 4]
    aux = 3 * (f[0] * P[0] + f[1] * P[1] + f[2] * P[2])
    z = ((math.log(6) + 0.0) ** 2 + (math.log(8) + 1.5) ** 2 + (math.log(8) - 2.0) ** 2
         + (math.log(8) + 0.25) ** 2) / 4
    assert moe.last_losses["aux"].item() == pytest.approx(aux, rel=BY_HAND_RTOL)
    assert moe.last_losses["z"].item() == pytest.approx(z, rel=BY_HAND_RTOL)
    # combine weights: renormalised top-2 probabilities of token 0: 3/5 for expert 2, 2/5 for expert 1
    assert route.topk_weight_TK[0].tolist() == pytest.approx([3 / 5, 2 / 5], rel=BY_HAND_RTOL)


def test_aux_loss_sigmoid_by_hand():
    moe, x = constructed_moe("sigmoid")
    moe(x)
    sig = [[1 / (1 + math.exp(-(math.log(a) + c))) for a in row] for row, c in zip(A, C, strict=True)]
    probs = [[s / sum(row) for s in row] for row in sig]
    top = [sorted(range(3), key=lambda e: -row[e])[:2] for row in sig]
    f = [sum(e in t for t in top) / 8 for e in range(3)]
    P = [sum(p[e] for p in probs) / 4 for e in range(3)]
    aux = 3 * sum(fe * pe for fe, pe in zip(f, P, strict=True))
    assert moe.last_losses["aux"].item() == pytest.approx(aux, rel=BY_HAND_RTOL)
    assert [set(t) for t in moe.last_route.topk_idx_TK.tolist()] == [set(t) for t in top]
    w0 = [sig[0][top[0][0]], sig[0][top[0][1]]]
    assert moe.last_route.topk_weight_TK[0].tolist() == pytest.approx([w / sum(w0) for w in w0], rel=BY_HAND_RTOL)


def test_load_balancing_loss_uniform_is_one_and_collapsed_is_E():
    probs = torch.full((4, 4), 0.25)
    assert load_balancing_loss(probs, torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])).item() == pytest.approx(1.0)
    onehot = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert load_balancing_loss(onehot, torch.zeros(4, 1, dtype=torch.long)).item() == pytest.approx(4.0)
    logits = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, rel=BY_HAND_RTOL)
