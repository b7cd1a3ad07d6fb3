"""Fitting the law (smelt_ds/study/scaling/fit.py): a noiseless and a noisy law recovered, bootstrap
intervals that cover the truth, clear errors for degenerate input, the Huber objective and its gradient."""

from __future__ import annotations

import numpy as np
import pytest

from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.fit import _objective, _objective_one, bootstrap, fit_law
from smelt_ds.study.scaling.law import FlopsModel
from tests.study.scaling.scaling_helpers import CHINCHILLA, law_grid


def test_fit_recovers_a_noiseless_law_exactly():
    fit = fit_law(*law_grid(CHINCHILLA))
    for name in ("E", "A", "alpha", "B", "beta"):
        assert getattr(fit.law, name) == pytest.approx(getattr(CHINCHILLA, name), rel=1e-4), name
    assert fit.at_bound == []


def test_fit_recovers_a_noisy_law_within_stated_tolerances():
    # 0.5% multiplicative noise on 36 runs: exponents within 0.03, E within 3%, and the fitted law
    # predicts held-out losses (outside the grid by 3x in N and D) within 1%
    N, D, L = law_grid(CHINCHILLA, noise=0.005, seed=1)
    fit = fit_law(N, D, L)
    assert abs(fit.law.alpha - CHINCHILLA.alpha) < 0.03
    assert abs(fit.law.beta - CHINCHILLA.beta) < 0.03
    assert fit.law.E == pytest.approx(CHINCHILLA.E, rel=0.03)
    for n, d in [(3e10, 3e12), (3e6, 3e8), (1e9, 5e10)]:
        assert fit.law(n, d) == pytest.approx(CHINCHILLA(n, d), rel=0.01)


def test_bootstrap_intervals_cover_the_true_exponents():
    N, D, L = law_grid(CHINCHILLA, n_sizes=5, n_tokens=4, noise=0.005, seed=2)
    pts = [RunPoint(f"r{i}", "x", float(loss), float(n), float(d), 6 * float(n))
           for i, (n, d, loss) in enumerate(zip(N, D, L, strict=True))]
    fits = {"x": fit_law(N, D, L)}
    boot = bootstrap({"x": pts}, fits, {"x": FlopsModel(0, 6)}, None, np.array([1e20]), n=20, seed=0)
    params = boot["x"]["params"]
    assert params.shape == (20, 5)
    lo, hi = np.percentile(params, [2.5, 97.5], axis=0)
    for i, true in enumerate([CHINCHILLA.E, CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta]):
        if i in (2, 4):  # the exponents
            assert lo[i] <= true <= hi[i]


def test_huber_objective_gradient_equals_finite_differences():
    from scipy.optimize import approx_fprime

    rng = np.random.default_rng(0)
    logN, logD = np.log(rng.uniform(1e6, 1e9, 15)), np.log(rng.uniform(1e8, 1e11, 15))
    logL = np.log(rng.uniform(2.0, 4.0, 15))
    theta = np.array([5.0, 6.0, 0.8, 0.4, 0.3])
    lse = np.logaddexp(np.logaddexp(theta[0] - theta[3] * logN, theta[1] - theta[4] * logD), theta[2])
    r = np.abs(lse - logL)
    delta = float(np.median(r))  # half the residuals in the quadratic part, half in the linear part
    assert (r < delta).any() and (r > delta).any()
    val, grad = _objective_one(theta, logN, logD, logL, delta)
    num = approx_fprime(theta, lambda t: _objective_one(t, logN, logD, logL, delta)[0], 1e-7)
    np.testing.assert_allclose(grad, num, rtol=1e-5)
    # the one-theta objective equals the vectorised (grid) one
    v2, g2 = _objective(theta[None, :], logN, logD, logL, delta)
    assert v2[0] == pytest.approx(val, rel=1e-12)
    np.testing.assert_allclose(g2[0], grad, rtol=1e-10)
    # and the Huber loss itself: 0.5 r^2 inside delta, delta (|r| - delta/2) outside, over delta^2
    huber = np.where(r <= delta, 0.5 * r ** 2, delta * (r - delta / 2))
    assert val == pytest.approx(huber.sum() / delta ** 2, rel=1e-12)
