"""The compute-optimal frontier of a fitted law (:func:`frontier`, :func:`compute_optimal`), the
compute that reaches a loss (:func:`compute_for_loss`) and the savings against the Baseline
(:func:`compute_savings`); and the model-free cross-checks from the runs themselves: their lower
envelope (:func:`envelope`, :func:`envelope_savings`) and IsoFLOP profiles
(:func:`isoflop_profiles`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.law import FlopsModel, ScalingLaw

__all__ = ["LOGN_RANGE", "frontier", "compute_optimal", "compute_for_loss", "compute_savings", "envelope",
           "envelope_savings", "isoflop_profiles"]

LOGN_RANGE = (math.log(1.0), math.log(1e30))  # search range of N on the frontier (parameters)
_GOLDEN = (math.sqrt(5) - 1) / 2


def _loss_at(law: ScalingLaw, fm: FlopsModel, x: np.ndarray, C: np.ndarray) -> np.ndarray:
    N = np.exp(x)
    return law(N, C / fm(N))


def _log_compute_at(law: ScalingLaw, fm: FlopsModel, x: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """log of the training FLOPs a model of ``e^x`` parameters needs to reach ``loss``: ``f(N) D``
    with ``D = (B / (loss - E - A N^-alpha))^(1/beta)``; +inf where that model cannot reach it."""
    N = np.exp(x)
    gap = loss - law.E - law.A * N ** -law.alpha
    with np.errstate(divide="ignore", invalid="ignore"):
        val = np.log(fm(N)) + (math.log(law.B) - np.log(gap)) / law.beta
    return np.where(gap > 0, val, np.inf)


def _min_over_logn(fun, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``min_x fun(x, target)`` over ``x = log N`` in :data:`LOGN_RANGE`: a 600-point grid,
    then golden-section search between the grid neighbours of the best point. Returns
    ``(x_min, f_min)``; NaN where the minimum is on the range's edge or nowhere finite."""
    xs = np.linspace(*LOGN_RANGE, 600)
    vals = fun(xs[None, :], target[:, None])
    i = np.argmin(vals, axis=1)
    bad = (i == 0) | (i == len(xs) - 1) | ~np.isfinite(vals[np.arange(len(i)), i])
    lo, hi = xs[np.clip(i - 1, 0, len(xs) - 1)], xs[np.clip(i + 1, 0, len(xs) - 1)]
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = fun(x1, target), fun(x2, target)
    for _ in range(60):
        left = f1 < f2
        hi, lo = np.where(left, x2, hi), np.where(left, lo, x1)
        x1, x2 = np.where(left, hi - _GOLDEN * (hi - lo), x2), np.where(left, x1, lo + _GOLDEN * (hi - lo))
        f1, f2 = fun(x1, target), fun(x2, target)
    x = (lo + hi) / 2
    nan = np.where(bad, np.nan, 1.0)
    return x * nan, fun(x, target) * nan


def frontier(law: ScalingLaw, fm: FlopsModel, C) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute-optimal frontier at training compute ``C`` (FLOPs; scalar or array).

    Returns ``(L*, N_opt, D_opt)``: ``L*(C) = min_N L(N, C / f(N))`` (nats/token), the
    minimising non-embedding parameters and ``D_opt = C / f(N_opt)`` tokens, found over ``log N``
    in :data:`LOGN_RANGE` (NaN when the optimum lies on its edge).
    """
    C = np.atleast_1d(np.asarray(C, dtype=float))
    if law.alpha <= 0 or law.beta <= 0:  # no trade-off between N and D: no optimum
        nan = np.full_like(C, np.nan)
        return nan, nan, nan
    x, L = _min_over_logn(lambda x, c: _loss_at(law, fm, x, c), C)
    N = np.exp(x)
    return L, N, C / fm(N)


def compute_optimal(law: ScalingLaw, fm: FlopsModel, C) -> dict[str, np.ndarray]:
    """``{"C", "loss", "N_opt", "D_opt", "tokens_per_param"}`` on the frontier (see :func:`frontier`)."""
    L, N, D = frontier(law, fm, C)
    return {"C": np.atleast_1d(np.asarray(C, dtype=float)), "loss": L, "N_opt": N, "D_opt": D,
            "tokens_per_param": D / N}


def compute_for_loss(law: ScalingLaw, fm: FlopsModel, loss) -> np.ndarray:
    """Least training FLOPs at which the architecture reaches ``loss`` (nats/token): the inverse of
    the frontier ``L*(C)``, solved directly as ``min_N f(N) D(N)`` with ``D(N)`` the tokens that
    bring ``L(N, D)`` down to ``loss``. NaN when the loss is not reachable (``loss <= E``)."""
    loss = np.atleast_1d(np.asarray(loss, dtype=float))
    if law.alpha <= 0 or law.beta <= 0:
        return np.full_like(loss, np.nan)
    _, logc = _min_over_logn(lambda x, target: _log_compute_at(law, fm, x, target), loss)
    return np.exp(logc)


def compute_savings(base: ScalingLaw, base_fm: FlopsModel, other: ScalingLaw, other_fm: FlopsModel,
                    C) -> dict[str, np.ndarray]:
    """Savings of ``other`` vs the Baseline ``base`` on their compute-optimal frontiers.

    At Baseline training compute ``C`` (FLOPs): ``loss = L*_B(C)``, ``C_other`` = the compute at
    which ``other`` reaches that loss, ``saving = 1 - C_other / C`` (fraction of training FLOPs
    saved at equal loss; negative = costs more), ``loss_delta = L*_other(C) - L*_B(C)`` (nats/token,
    at equal compute; negative = better).
    """
    C = np.atleast_1d(np.asarray(C, dtype=float))
    lb = frontier(base, base_fm, C)[0]
    Co = compute_for_loss(other, other_fm, lb)
    return {"C": C, "baseline_loss": lb, "C_other": Co, "saving": 1 - Co / C,
            "loss_delta": frontier(other, other_fm, C)[0] - lb}


def envelope(points: list[RunPoint]) -> list[RunPoint]:
    """Lower envelope of loss vs training compute: runs (sorted by C) whose loss is below that of
    every cheaper run (Hoffmann et al. 2022 Approach 1 in spirit, final losses only)."""
    out, best = [], math.inf
    for p in sorted(points, key=lambda p: (p.C, p.loss)):
        if p.loss < best:
            out.append(p)
            best = p.loss
    return out


def isoflop_profiles(points: list[RunPoint], rel_tol: float = 0.1, min_sizes: int = 3) -> list[dict[str, Any]]:
    """IsoFLOP profiles (Hoffmann et al. 2022, Approach 2): groups of runs whose training compute
    lies within ``rel_tol`` of the group's smallest, with ``min_sizes`` distinct N; a parabola of
    loss in ``log N`` gives ``N_opt`` at the group's (geometric-mean) compute when it opens upward
    and its vertex lies within the sizes run."""
    groups: list[list[RunPoint]] = []
    for p in sorted(points, key=lambda p: p.C):
        if groups and p.C <= groups[-1][0].C * (1 + rel_tol):
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        if len({p.N for p in g}) < min_sizes:
            continue
        x, y = np.log([p.N for p in g]), np.array([p.loss for p in g])
        c2, c1, c0 = np.polyfit(x, y, 2)
        C = float(np.exp(np.mean(np.log([p.C for p in g]))))
        row = {"C": C, "runs": len(g), "N": sorted({p.N for p in g}), "N_opt": None, "loss_opt": None}
        if c2 > 0 and x.min() <= -c1 / (2 * c2) <= x.max():
            xv = -c1 / (2 * c2)
            row["N_opt"], row["loss_opt"] = float(np.exp(xv)), float(c0 + c1 * xv + c2 * xv * xv)
        out.append(row)
    return out


def envelope_savings(base_env: list[RunPoint], other_env: list[RunPoint]) -> list[dict[str, float]]:
    """At each Baseline envelope run's loss, the other architecture's envelope compute at that loss
    (log-log interpolation along its envelope; only inside its loss range)."""
    if len(other_env) < 2:
        return []
    lc = np.log([p.C for p in other_env])
    ll = np.array([p.loss for p in other_env])  # decreasing along the envelope
    out = []
    for p in base_env:
        if ll.min() <= p.loss <= ll.max():
            c = float(np.exp(np.interp(p.loss, ll[::-1], lc[::-1])))
            out.append({"C": p.C, "loss": p.loss, "C_other": c, "saving": 1 - c / p.C})
    return out
