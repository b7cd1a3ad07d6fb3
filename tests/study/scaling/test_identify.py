"""Identification checks of a fit (smelt_ds/study/scaling/identify.py): an IsoFLOP ladder drawn from a
known law is identified and its N_opt per budget equals Chinchilla's closed form; sizes all below
N_opt, E on the bound and intervals wider than +-30% are each reported as the shortfall they are."""

from __future__ import annotations

import numpy as np
import pytest

from smelt_ds.study.scaling.analysis import analyse
from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.fit import FitResult
from smelt_ds.study.scaling.identify import identification
from smelt_ds.study.scaling.law import FlopsModel, ScalingLaw
from smelt_ds.study.scaling.report import report_markdown
from tests.study.scaling.scaling_helpers import CHINCHILLA, closed_form

K = 6.0  # C = 6 N D
BUDGETS = (1e19, 1e20, 1e21)


def _isoflop_ladder(size_factors, per_budget=True):
    """Runs of the exact Chinchilla law at each budget, sizes = closed-form N_opt x factors (N_opt of
    each budget, or of the smallest for every budget)."""
    pts = []
    for c in BUDGETS:
        n_opt = closed_form(CHINCHILLA, K, c if per_budget else BUDGETS[0])[1]
        for j, f in enumerate(size_factors):
            n = float(n_opt * f)
            d = c / (K * n)
            pts.append(RunPoint(f"b/{c:g}-{j}", "baseline", float(CHINCHILLA(n, d)), n, d, K * n))
    return pts


def test_an_isoflop_ladder_of_a_known_law_is_identified_with_the_closed_form_n_opt():
    pts = _isoflop_ladder((1 / 4, 1 / 2, 1, 2, 4))
    res = analyse(pts, n_bootstrap=4, n_starts=8)
    ident = res["architectures"]["baseline"]["identification"]
    assert ident["identified"] and ident["shortfalls"] == []
    assert ident["E_off_bound"] and ident["E_bound_share"] == 0.0
    assert ident["budgets_inside"] == 3 and [b["C"] for b in ident["budgets"]] == pytest.approx(BUDGETS, rel=1e-9)
    # exact data: the fit recovers the exponents to ~1e-3 relative (test_analysis), and
    # d ln N_opt / d beta = alpha ln(C/k) / (alpha + beta)^2 ~ 40 at these budgets, so a 3e-4 error in
    # beta moves N_opt by ~1%; 3% allows both exponents' errors
    for b in ident["budgets"]:
        assert b["N_opt"] == pytest.approx(closed_form(CHINCHILLA, K, b["C"])[1], rel=3e-2)
        assert b["inside"] and b["N_opt_isoflop"] is not None
    md = report_markdown(res, {})
    assert "| baseline | yes | yes (0%) |" in md and "| 3 of 3 |" in md
    assert "not identified" not in md


def test_sizes_all_below_n_opt_leave_the_frontier_outside_the_measured_sizes():
    pts = _isoflop_ladder((1 / 64, 1 / 32, 1 / 16, 1 / 8), per_budget=False)
    res = analyse(pts, n_bootstrap=4, n_starts=8)
    ident = res["architectures"]["baseline"]["identification"]
    assert not ident["identified"] and ident["budgets_inside"] == 0
    assert all(b["N_opt_isoflop"] is None for b in ident["budgets"])  # the parabolas have no interior minimum
    hi = max(p.N for p in pts)
    n_opt = [closed_form(CHINCHILLA, K, c)[1] for c in BUDGETS]
    assert ident["shortfalls"][-1] == (
        "the frontier's N_opt lies inside the sizes run at 0 of 3 IsoFLOP budget(s) (needed: 2): " + "; ".join(
            f"at {c:.3g} FLOPs N_opt {b['N_opt']:.3g} is {b['N_opt'] / hi - 1:.0%} above the largest size run "
            f"there ({hi:.3g})" for c, b in zip(BUDGETS, ident["budgets"], strict=True)))
    for b, n in zip(ident["budgets"], n_opt, strict=True):  # 8x the largest size at the smallest budget
        assert b["N_opt"] == pytest.approx(n, rel=3e-2) and b["N_opt"] / hi > 7
    assert "- baseline, not identified: the frontier's N_opt" in report_markdown(res, {})


def test_n_opt_is_checked_against_the_sizes_run_at_its_own_budget():
    # the smallest budget's sizes lie below its N_opt; the largest budget's include smaller sizes
    # than that N_opt, so the range of all runs covers it but the budget's own sizes do not
    n19, n20, n21 = (closed_form(CHINCHILLA, K, c)[1] for c in BUDGETS)
    sizes = {1e19: [n19 / 16, n19 / 8, n19 / 4], 1e20: [n20 / 2, n20, n20 * 2], 1e21: [n21 / 16, n21 / 2, n21, n21 * 2]}
    assert min(sizes[1e21]) < n19 < max(sizes[1e21])
    pts = [RunPoint("r", "baseline", 3.0, float(n), 1e9, K * n) for ns in sizes.values() for n in ns]
    iso = [{"C": c, "N": ns, "N_opt": None} for c, ns in sizes.items()]
    ident = identification(FitResult(CHINCHILLA, 0.0), FlopsModel(0.0, K), pts, None, iso)
    assert [b["inside"] for b in ident["budgets"]] == [False, True, True] and ident["budgets_inside"] == 2
    assert ident["budgets"][0]["N_range"] == pytest.approx([n19 / 16, n19 / 4], rel=1e-12)
    assert ident["budgets"][0]["N_opt"] == pytest.approx(n19, rel=1e-5)  # frontier vs closed form: test_frontier
    # two budgets inside: only the missing bootstrap keeps the fit from being identified
    assert [s.split("'")[0] for s in ident["shortfalls"]] == ["alpha", "beta"]
    one = identification(FitResult(CHINCHILLA, 0.0), FlopsModel(0.0, K), pts, None, iso, min_budgets=3)
    assert one["shortfalls"][-1].endswith(f"at 1e+19 FLOPs N_opt {ident['budgets'][0]['N_opt']:.3g} is 300% above "
                                          f"the largest size run there ({n19 / 4:.3g})")


def _one_budget_inside():
    """A fit of the exact law, its runs spanning N_opt at C = 1e20 only (below it at 1e16, above at 1e23)."""
    n_opt = closed_form(CHINCHILLA, K, 1e20)[1]
    pts = [RunPoint("r", "baseline", 3.0, float(n_opt * f), 1e9, K * n_opt) for f in (0.5, 2.0)]
    ns = [p.N for p in pts]
    iso = [{"C": c, "N": ns, "N_opt": None} for c in (1e16, 1e20, 1e23)]
    return pts, iso


@pytest.mark.parametrize("lo,hi,within", [(0.71, 1.29, True), (0.69, 1.0, False), (1.0, 1.31, False)])
def test_an_exponent_interval_counts_only_within_30_percent_of_its_estimate(lo, hi, within):
    pts, iso = _one_budget_inside()
    a, b = CHINCHILLA.alpha, CHINCHILLA.beta
    ci = {"alpha": [lo * a, hi * a], "beta": [0.9 * b, 1.1 * b]}
    ident = identification(FitResult(CHINCHILLA, 0.0), FlopsModel(0.0, K), pts, ci, iso, min_budgets=1)
    assert ident["exponents"]["alpha"]["within"] is within and ident["exponents"]["beta"]["within"]
    assert ident["exponents"]["alpha"]["ci95_rel"] == pytest.approx([lo - 1, hi - 1], rel=1e-9)
    assert [x["inside"] for x in ident["budgets"]] == [False, True, False] and ident["budgets_inside"] == 1
    assert ident["identified"] is within
    # one budget of three inside is short of the default two
    two = identification(FitResult(CHINCHILLA, 0.0), FlopsModel(0.0, K), pts, ci, iso)
    assert not two["identified"]
    assert "at 1 of 3 IsoFLOP budget(s) (needed: 2): at 1e+16 FLOPs N_opt" in two["shortfalls"][-1]
    assert "below the smallest size run there" in two["shortfalls"][-1].split(";")[-2]
    if not within:
        assert ident["shortfalls"] == [f"alpha's 95% interval [{lo * a:.3g}, {hi * a:.3g}] is {lo - 1:+.0%} / "
                                       f"{hi - 1:+.0%} of its estimate {a:.3g} (needed: within +-30%)"]


def test_e_on_the_bound_and_a_missing_bootstrap_are_shortfalls():
    pts, iso = _one_budget_inside()
    fit = FitResult(CHINCHILLA, 0.0, at_bound=["log E"])
    e_samples = np.array([np.exp(-10.0), 1.7, np.exp(-10.0), 1.6])
    ident = identification(fit, FlopsModel(0.0, K), pts, None, iso, e_samples=e_samples, min_budgets=1)
    assert not ident["identified"] and not ident["E_off_bound"] and ident["E_bound_share"] == 0.5
    assert ident["shortfalls"][:3] == [f"E is on the optimiser's bound ({CHINCHILLA.E:.3g})"] + [
        f"{n}'s 95% interval is not available (no bootstrap: `--bootstrap 0`, or every resample failed)"
        for n in ("alpha", "beta")]
    # the share counts both ends of E's box (log E in [-10, 5])
    both = identification(fit, FlopsModel(0.0, K), pts, None, iso, e_samples=np.exp([-10.0, 5.0, 0.5, 0.6]))
    assert both["E_bound_share"] == 0.5


def test_an_exponent_on_its_bound_and_a_sweep_without_isoflop_budgets_fail_with_their_reason():
    pts, _ = _one_budget_inside()
    law = ScalingLaw(CHINCHILLA.E, CHINCHILLA.A, 5.0, CHINCHILLA.B, CHINCHILLA.beta)
    ci = {"alpha": [5.0, 5.0], "beta": [0.9 * law.beta, 1.1 * law.beta]}  # a zero-width interval on the bound
    ident = identification(FitResult(law, 0.0, at_bound=["alpha"]), FlopsModel(0.0, K), pts, ci, [])
    assert not ident["exponents"]["alpha"]["within"] and ident["exponents"]["beta"]["within"]
    assert ident["shortfalls"] == [
        "alpha is on the optimiser's bound (5): the fit has no usable N exponent",
        "no IsoFLOP budget (3 or more sizes at one training compute), so N_opt cannot be checked against the "
        "sizes run: give the sweep `flops:` budgets"]
