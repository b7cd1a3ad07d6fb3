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
   at that budget's compute lies inside the range of sizes run at that budget.
"""

from __future__ import annotations

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
# the box of the fit (fit.BOUNDS, on log A, log B, log E, alpha, beta) for the exponents
_PARAM_BOUNDS = {"alpha": BOUNDS[3], "beta": BOUNDS[4]}


def _bound_text(x: float, name: str) -> str:
    """``x`` with ``(at bound)`` where it sits on the optimiser's box for ``name``."""
    lo, hi = _PARAM_BOUNDS[name]
    return f"{x:.3g}" + (" (at bound)" if min(abs(x - lo), abs(hi - x)) <= 1e-6 * max(1.0, abs(x)) else "")


def _outside_text(n_opt: float | None, lo: float, hi: float) -> str:
    if n_opt is None:
        return "no frontier optimum (N_opt on the search range's edge)"
    if n_opt < lo:
        return f"N_opt {n_opt:.3g} is {1 - n_opt / lo:.0%} below the smallest size run there ({lo:.3g})"
    return f"N_opt {n_opt:.3g} is {n_opt / hi - 1:.0%} above the largest size run there ({hi:.3g})"


def identification(fit: FitResult, fm: FlopsModel, points: Sequence[RunPoint],
                   params_ci95: dict[str, list[float]] | None, isoflop: Sequence[dict[str, Any]],
                   e_samples: np.ndarray | None = None, rel: float = EXPONENT_REL_TOL,
                   min_budgets: int = MIN_BUDGETS_INSIDE) -> dict[str, Any]:
    """The three identification checks of one architecture's fit (module docstring).

    ``points``: the runs fitted (non-embedding parameters ``N``); ``params_ci95``: ``{name: [low,
    high]}`` 95% bootstrap intervals (None: no bootstrap, so check 2 cannot pass); ``isoflop``:
    :func:`~smelt_ds.study.scaling.frontier.isoflop_profiles` of the runs, one row per budget
    (training FLOPs ``C``, the sizes ``N`` run at it and the parabola's ``N_opt``, Approach 2): the
    law's ``N_opt`` at a budget must lie inside the sizes run *at that budget*; ``e_samples``: the
    bootstrap resamples' ``E`` (reported, not checked: the share on either bound of the box).

    Check 1 looks at the full-data fit only; an exponent on its bound fails check 2 whatever its
    interval (no trade-off between N and D, or one the box cuts off).

    Returns ``{"identified", "E_off_bound", "E_bound_share", "exponents": {name: {"estimate",
    "ci95", "ci95_rel" ([low, high] / estimate - 1), "on_bound", "within"}}, "budgets": [{"C",
    "N_opt" (law), "N_opt_isoflop" (parabola), "N_range" (sizes run there), "inside"}],
    "budgets_inside", "N_range" (all runs), "rel", "min_budgets", "bootstrap" (intervals available),
    "shortfalls" (one sentence per failed check, saying by how much)}``.
    """
    law = fit.law
    shortfalls: list[str] = []
    e_off = "log E" not in fit.at_bound
    share = None
    if e_samples is not None and len(e_samples):
        log_e = np.log(np.asarray(e_samples, dtype=float))
        share = float(np.mean((log_e <= BOUNDS[2][0] + 1e-6) | (log_e >= BOUNDS[2][1] - 1e-6)))
    if not e_off:
        shortfalls.append(f"E is on the optimiser's bound ({law.E:.3g})")
    exponents: dict[str, Any] = {}
    for name in ("alpha", "beta"):
        est = float(getattr(law, name))
        on_bound = name in fit.at_bound
        ci = params_ci95.get(name) if params_ci95 else None
        if ci is not None and not all(np.isfinite(ci)):
            ci = None
        ci_rel = [ci[0] / est - 1, ci[1] / est - 1] if ci is not None and est > 0 else None
        within = bool(not on_bound and ci_rel is not None and ci_rel[0] >= -rel and ci_rel[1] <= rel)
        exponents[name] = {"estimate": est, "ci95": ci, "ci95_rel": ci_rel, "on_bound": on_bound, "within": within}
        if on_bound:
            shortfalls.append(f"{name} is on the optimiser's bound ({est:.3g}): the fit has no usable "
                              f"{'N' if name == 'alpha' else 'D'} exponent")
        elif ci is None:
            shortfalls.append(f"{name}'s 95% interval is not available (no bootstrap: `--bootstrap 0`, or "
                              "every resample failed)")
        elif not within and ci_rel is not None:
            shortfalls.append(f"{name}'s 95% interval [{_bound_text(ci[0], name)}, {_bound_text(ci[1], name)}] is "
                              f"{ci_rel[0]:+.0%} / {ci_rel[1]:+.0%} of its estimate {est:.3g} "
                              f"(needed: within +-{rel:.0%})")
    budgets = []
    if isoflop:
        opt = compute_optimal(law, fm, [g["C"] for g in isoflop])
        for g, n_opt in zip(isoflop, opt["N_opt"], strict=True):
            lo, hi = float(min(g["N"])), float(max(g["N"]))
            finite = bool(np.isfinite(n_opt))
            budgets.append({"C": float(g["C"]), "N_opt": float(n_opt) if finite else None,
                            "N_opt_isoflop": g["N_opt"], "N_range": [lo, hi],
                            "inside": bool(finite and lo <= n_opt <= hi)})
    n_inside = sum(b["inside"] for b in budgets)
    if not budgets:
        shortfalls.append("no IsoFLOP budget (3 or more sizes at one training compute), so N_opt cannot be "
                          "checked against the sizes run: give the sweep `flops:` budgets")
    elif n_inside < min_budgets:
        missed = "; ".join(f"at {b['C']:.3g} FLOPs {_outside_text(b['N_opt'], *b['N_range'])}"
                           for b in budgets if not b["inside"])
        shortfalls.append(f"the frontier's N_opt lies inside the sizes run at {n_inside} of {len(budgets)} "
                          f"IsoFLOP budget(s) (needed: {min_budgets}): {missed}")
    return {"identified": not shortfalls, "E_off_bound": e_off, "E_bound_share": share, "exponents": exponents,
            "budgets": budgets, "budgets_inside": n_inside,
            "N_range": [min(p.N for p in points), max(p.N for p in points)], "rel": rel,
            "min_budgets": min_budgets, "bootstrap": params_ci95 is not None, "shortfalls": shortfalls}
