"""Frontiers and savings (smelt_ds/study/scaling/frontier.py) against Chinchilla's closed form and brute
force; the envelope and IsoFLOP profiles against a direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.frontier import (
    compute_for_loss,
    compute_savings,
    envelope,
    frontier,
    isoflop_profiles,
)
from smelt_ds.study.scaling.law import FlopsModel, ScalingLaw
from tests.study.scaling.scaling_helpers import CHINCHILLA, closed_form


def test_frontier_equals_chinchilla_closed_form_for_C_equal_kND():
    C = np.geomspace(1e18, 1e25, 8)
    L, N, D = frontier(CHINCHILLA, FlopsModel(0.0, 6.0), C)
    L_cf, N_cf, _, _ = closed_form(CHINCHILLA, 6.0, C)
    np.testing.assert_allclose(L, L_cf, rtol=1e-10)
    np.testing.assert_allclose(N, N_cf, rtol=1e-5)
    np.testing.assert_allclose(6 * N * D, C, rtol=1e-12)


def test_frontier_with_fixed_flops_per_token_equals_brute_force():
    # f(N) = f0 + f1 N with f0 > 0 (head and attention FLOPs): compare with a dense direct search
    fm = FlopsModel(2e6, 7.5)
    C = np.array([1e12, 1e15, 1e19])
    L, N, D = frontier(CHINCHILLA, fm, C)
    n = np.geomspace(1e2, 1e16, 400_001)
    for i, c in enumerate(C):
        vals = CHINCHILLA(n, c / fm(n))
        j = np.argmin(vals)
        assert L[i] == pytest.approx(vals[j], rel=1e-9)
        assert N[i] == pytest.approx(n[j], rel=1e-3)
        assert D[i] * fm(N[i]) == pytest.approx(c, rel=1e-12)
    # and the inverse: the compute needed to reach L*(C) is C
    np.testing.assert_allclose(compute_for_loss(CHINCHILLA, fm, L), C, rtol=1e-6)


def test_savings_for_laws_differing_in_A_equal_closed_form():
    # A_X = r A_B, C = k N D for both: L*_X(C) = E + r^(b/(a+b)) K (C/k)^-g, so at equal loss
    # C_X / C_B = r^(1/alpha) at every C, and the saving is 1 - r^(1/alpha).
    r, k = 0.9, 6.0
    other = ScalingLaw(CHINCHILLA.E, r * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    C = np.geomspace(1e18, 1e25, 6)
    s = compute_savings(CHINCHILLA, FlopsModel(0, k), other, FlopsModel(0, k), C)
    np.testing.assert_allclose(s["saving"], 1 - r ** (1 / CHINCHILLA.alpha), rtol=1e-6)
    Lb, _, K, g = closed_form(CHINCHILLA, k, C)
    Lo, _, Ko, _ = closed_form(other, k, C)
    assert Ko / K == pytest.approx(r ** (CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)), rel=1e-12)
    np.testing.assert_allclose(s["loss_delta"], Lo - Lb, rtol=1e-8)


def test_savings_for_laws_differing_in_E_equal_closed_form():
    # E_X = E_B - delta: E - delta + K (C_X/k)^-g = E + K (C_B/k)^-g
    # => C_X = k ((C_B/k)^-g + delta/K)^(-1/g): the saving grows with compute
    delta, k = 0.02, 6.0
    other = ScalingLaw(CHINCHILLA.E - delta, CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    C = np.geomspace(1e18, 1e25, 6)
    s = compute_savings(CHINCHILLA, FlopsModel(0, k), other, FlopsModel(0, k), C)
    _, _, K, g = closed_form(CHINCHILLA, k, C)
    C_x = k * ((C / k) ** -g + delta / K) ** (-1 / g)
    np.testing.assert_allclose(s["C_other"], C_x, rtol=1e-6)
    np.testing.assert_allclose(s["saving"], 1 - C_x / C, rtol=1e-5)
    assert np.all(np.diff(s["saving"]) > 0)
    np.testing.assert_allclose(s["loss_delta"], -delta, rtol=1e-8)


def test_savings_from_flops_per_token_alone():
    # the same law but 10% more FLOPs per token: 10% more compute for every loss (saving -0.1)
    C = np.geomspace(1e18, 1e24, 4)
    s = compute_savings(CHINCHILLA, FlopsModel(0, 6.0), CHINCHILLA, FlopsModel(0, 6.6), C)
    np.testing.assert_allclose(s["saving"], -0.1, rtol=1e-6)
    Lb, _, K, g = closed_form(CHINCHILLA, 6.0, C)
    np.testing.assert_allclose(s["loss_delta"], K * (C / 6.6) ** -g - K * (C / 6.0) ** -g, rtol=1e-8)


def test_unreachable_loss_gives_nan():
    assert math.isnan(compute_for_loss(CHINCHILLA, FlopsModel(0, 6), CHINCHILLA.E - 0.1)[0])


def test_envelope_and_isoflop_profiles_against_direct_computation():
    law, k = CHINCHILLA, 6.0
    pts = []
    for C in (1e19, 1e20, 1e21):
        n_opt = closed_form(law, k, C)[1]
        for n in n_opt * np.geomspace(1 / 5, 3, 9):  # sizes around the optimum, not centred on it
            pts.append(RunPoint("r", "x", float(law(n, C / (k * n))), float(n), C / (k * n), k * float(n)))
    env = envelope(pts)
    # direct: sorted by compute, each envelope run beats every cheaper run
    for p in env:
        assert all(q.loss > p.loss for q in pts if q.C < p.C * (1 - 1e-12))
    assert env[-1].loss == min(p.loss for p in pts)
    prof = isoflop_profiles(pts)
    assert len(prof) == 3
    _, N_cf, _, _ = closed_form(law, k, np.array([g["C"] for g in prof]))
    for g, n in zip(prof, N_cf, strict=True):
        assert g["N_opt"] == pytest.approx(n, rel=0.15)  # a parabola in log N approximates the profile
        assert g["N_opt"] != pytest.approx(n, rel=1e-3)  # ... but is not the closed form itself
