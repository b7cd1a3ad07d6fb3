"""Is a fitted law identified by its runs? Three checks on one architecture's Approach-3 fit
(:func:`identification`), and the comparison of its compute-optimal size with the IsoFLOP parabolas'
(Approach 2) at each budget of the sweep.

A law fitted to too few or too narrow runs can reproduce them well and still say nothing about the
frontier: ``E`` runs to the optimiser's bound and trades off against ``A`` and ``B``, the exponents'
bootstrap intervals span orders of magnitude, and ``N_opt`` falls outside the sizes that were run
(so the frontier, and every saving read off it, is extrapolation). The checks, with the thresholds
smelt-ds uses by default (issue 28's definition, in the spirit of Besiroglu et al. 2024, arXiv
2404.10102, who judged Chinchilla's Approach 3 by its estimates' intervals):

1. ``E`` is not on the optimiser's bound (:data:`~smelt_ds.study.scaling.fit.BOUNDS`) in the fit;
2. each exponent's (``alpha``, ``beta``) 95% bootstrap interval lies within ``+-rel`` of its
   estimate (default 30%);
3. at ``min_budgets`` (default 2) or more of the sweep's IsoFLOP budgets, the frontier's ``N_opt``
   at that budget's compute lies inside the range of sizes run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.fit import BOUNDS, FitResult
from smelt_ds.study.scaling.frontier import compute_optimal
from smelt_ds.study.scaling.law import FlopsModel

__all__ = ["EXPONENT_REL_TOL", "MIN_BUDGETS_INSIDE", "identification"]

EXPONENT_REL_TOL = 0.30   # each exponent's 95% interval within +-30% of its estimate
MIN_BUDGETS_INSIDE = 2    # budgets whose frontier N_opt lies inside the measured sizes
E_LOWER_BOUND = math.exp(BOUNDS[2][0])  # the smallest E the fit may return


def identification(fit: FitResult, fm: FlopsModel, points: Sequence[RunPoint],
                   params_ci95: dict[str, list[float]] | None, isoflop: Sequence[dict[str, Any]],
                   e_samples: np.ndarray | None = None, rel: float = EXPONENT_REL_TOL,
                   min_budgets: int = MIN_BUDGETS_INSIDE) -> dict[str, Any]:
    """The three identification checks of one architecture's fit (module docstring).

    ``points``: the runs fitted (their ``N``, non-embedding parameters, give the measured size
    range); ``params_ci95``: ``{name: [low, high]}`` 95% bootstrap intervals (None: no bootstrap,
    check 2 fails); ``isoflop``: :func:`~smelt_ds.study.scaling.frontier.isoflop_profiles` of the
    runs, one row per budget (training FLOPs ``C`` and the parabola's ``N_opt``, Approach 2);
    ``e_samples``: the bootstrap resamples' ``E`` (reported: the share on the bound).

    Returns ``{"identified", "E_off_bound", "E_bound_share", "exponents": {name: {"estimate",
    "ci95", "ci95_rel" ([low, high] / estimate - 1), "within"}}, "budgets": [{"C", "N_opt" (law),
    "N_opt_isoflop" (parabola), "inside"}], "budgets_inside", "N_range", "rel", "min_budgets",
    "shortfalls" (one sentence per failed check, saying by how much)}``.
    """
    law = fit.law
    n_lo, n_hi = min(p.N for p in points), max(p.N for p in points)
    shortfalls: list[str] = []
    e_off = "log E" not in fit.at_bound
    share = (float(np.mean(np.asarray(e_samples) <= E_LOWER_BOUND * (1 + 1e-6)))
             if e_samples is not None and len(e_samples) else None)
    if not e_off:
        shortfalls.append(f"E is on the optimiser's bound ({law.E:.3g})")
    exponents: dict[str, Any] = {}
    for name in ("alpha", "beta"):
        est = float(getattr(law, name))
        ci = params_ci95.get(name) if params_ci95 else None
        ci_rel = [ci[0] / est - 1, ci[1] / est - 1] if ci and est > 0 else None
        within = bool(ci_rel is not None and ci_rel[0] >= -rel and ci_rel[1] <= rel)
        exponents[name] = {"estimate": est, "ci95": ci, "ci95_rel": ci_rel, "within": within}
        if not within and ci and ci_rel:
            shortfalls.append(f"{name}'s 95% interval [{ci[0]:.3g}, {ci[1]:.3g}] is {ci_rel[0]:+.0%} / "
                              f"{ci_rel[1]:+.0%} of its estimate {est:.3g} (needed: within +-{rel:.0%})")
        elif not within:
            shortfalls.append(f"{name}'s 95% interval is not available (no bootstrap)")
    budgets = []
    if isoflop:
        opt = compute_optimal(law, fm, [g["C"] for g in isoflop])
        for g, n_opt in zip(isoflop, opt["N_opt"], strict=True):
            inside = bool(np.isfinite(n_opt) and n_lo <= n_opt <= n_hi)
            budgets.append({"C": float(g["C"]), "N_opt": float(n_opt) if np.isfinite(n_opt) else None,
                            "N_opt_isoflop": g["N_opt"], "inside": inside})
    n_inside = sum(b["inside"] for b in budgets)
    if n_inside < min_budgets:
        shortfalls.append(f"the frontier's N_opt lies inside the measured sizes ({n_lo:.3g}-{n_hi:.3g}) at "
                          f"{n_inside} of {len(budgets)} IsoFLOP budget(s) (needed: {min_budgets})")
    return {"identified": not shortfalls, "E_off_bound": e_off, "E_bound_share": share, "exponents": exponents,
            "budgets": budgets, "budgets_inside": n_inside, "N_range": [n_lo, n_hi], "rel": rel,
            "min_budgets": min_budgets, "shortfalls": shortfalls}
