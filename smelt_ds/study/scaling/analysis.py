"""The whole analysis (:func:`analyse`): per architecture the fitted law, its FLOPs model, frontier and
savings against the Baseline with bootstrap intervals, the envelope and IsoFLOP cross-checks; and
the fit-free comparison of matched runs (:func:`paired_comparison`). The result is plain data,
what :mod:`smelt_ds.study.scaling.report` writes."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from smelt_ds.errors import ConfigError
from smelt_ds.study.scaling.collect import Exclusion, RunPoint, average_replicates, summarize_exclusions
from smelt_ds.study.scaling.fit import HUBER_DELTA, FitResult, bootstrap, fit_points, percentile_interval
from smelt_ds.study.scaling.frontier import (
    compute_optimal,
    compute_savings,
    envelope,
    envelope_savings,
    isoflop_profiles,
)
from smelt_ds.study.scaling.identify import identification
from smelt_ds.study.scaling.law import PARAM_NAMES, FlopsModel, fit_flops_model

__all__ = ["analyse", "paired_comparison", "replicate_spread"]


def _pick_baseline(by_arch: dict[str, list[RunPoint]], baseline: str | None) -> str | None:
    if baseline is not None:
        if baseline not in by_arch:
            raise ConfigError(f"--baseline {baseline!r} is not among the architectures found: {sorted(by_arch)}")
        return baseline
    if "baseline" in by_arch:
        return "baseline"
    unlooped = [a for a, pts in by_arch.items() if all(p.position == "none" for p in pts)]
    return unlooped[0] if len(unlooped) == 1 else None


def analyse(points: list[RunPoint], excluded: list[Exclusion] | None = None, baseline: str | None = None,
            n_bootstrap: int = 200, seed: int = 0, c_range: tuple[float, float] | None = None,
            n_c: int = 25, n_starts: int = 32) -> dict[str, Any]:
    """Fit every architecture, its frontier and its savings vs the Baseline, with bootstrap CIs.

    ``c_range``: training FLOPs range of the frontier/savings tables (default: from the cheapest
    run's compute to 100x the most expensive). Architectures without enough runs for a fit are
    reported as exclusions. Returns a JSON-serialisable dict (see :func:`write_report`).

    Replicates (runs of the same architecture, size and budget with other seeds) are averaged into
    one point before the fits, envelopes and IsoFLOP profiles (:func:`average_replicates`); the paired
    comparison pairs them seed by seed (:func:`paired_comparison`) and ``replicates`` reports their
    spread (:func:`replicate_spread`).

    Raises ConfigError when no architecture can be fitted.
    """
    excluded = list(excluded or [])
    runs_by_arch: dict[str, list[RunPoint]] = {}
    for p in points:
        runs_by_arch.setdefault(p.architecture, []).append(p)
    by_arch = {a: average_replicates(pts) for a, pts in runs_by_arch.items()}
    fits: dict[str, FitResult] = {}
    fms: dict[str, FlopsModel] = {}
    for arch, pts in sorted(by_arch.items()):
        try:
            fits[arch] = fit_points(pts, n_starts=n_starts)
            fms[arch] = fit_flops_model([p.N for p in pts], [p.flops_per_token for p in pts])
        except ConfigError as e:
            excluded.append(Exclusion(f"architecture {arch}", str(e)))
    if not fits:
        reasons = "; ".join(summarize_exclusions(excluded)) or "no finished runs"
        base = _pick_baseline(by_arch, baseline) if by_arch else None
        paired = {a: paired_comparison(runs_by_arch[base], pts) for a, pts in runs_by_arch.items()
                  if base and a != base}
        so_far = "; ".join(f"{a} - {base}: {pr['n_pairs']} pair(s), mean loss delta {pr['mean_delta']:+.4f} "
                           "nats/token" for a, pr in paired.items() if pr)
        raise ConfigError(f"no architecture has enough finished runs for a scaling-law fit: {reasons}"
                          + (f". Paired runs so far (same size and budget, no fit): {so_far}" if so_far else ""))
    base = _pick_baseline({a: by_arch[a] for a in fits}, baseline)
    fitted = [p for a in fits for p in by_arch[a]]
    cmin, cmax = min(p.C for p in fitted), max(p.C for p in fitted)
    lo, hi = c_range or (cmin, cmax * 100)
    if not (0 < lo < hi):
        raise ConfigError(f"--c-range ({lo:g}, {hi:g}) must be two positive FLOPs counts, low < high")
    C_grid = np.geomspace(lo, hi, n_c)
    boot = bootstrap(by_arch, fits, fms, base, C_grid, n=n_bootstrap, seed=seed) if n_bootstrap else {}
    archs: dict[str, Any] = {}
    for arch, fit in fits.items():
        pts = by_arch[arch]
        b = boot.get(arch, {})
        plo, phi = percentile_interval(b.get("params"))
        opt = compute_optimal(fit.law, fms[arch], C_grid)
        flo, fhi = percentile_interval(b.get("frontier"))
        pred = fit.law([p.N for p in pts], [p.D for p in pts])
        params_ci95 = ({n: [float(plo[i]), float(phi[i])] for i, n in enumerate(PARAM_NAMES)}
                       if plo is not None and phi is not None else None)
        isoflop = isoflop_profiles(pts)
        params_boot = b.get("params")
        archs[arch] = {
            "n_runs": len(pts), "params": fit.law.as_dict(), "objective": fit.objective,
            "at_bound": fit.at_bound, "converged": fit.converged, "params_ci95": params_ci95,
            "rmse_log_loss": float(np.sqrt(np.mean((np.log(pred) - np.log([p.loss for p in pts])) ** 2))),
            "flops_per_token": {"f0": fms[arch].f0, "fh": fms[arch].fh, "f1": fms[arch].f1,
                                "max_rel_residual": fms[arch].max_rel_residual},
            "frontier": {k: v.tolist() for k, v in opt.items()},
            "frontier_ci95": [flo.tolist(), fhi.tolist()] if flo is not None and fhi is not None else None,
            "bootstrap_samples": int(len(b.get("params", []))), "bootstrap_failed": int(b.get("failed", 0)),
            "envelope": [_point_dict(p) for p in envelope(pts)],
            "isoflop": isoflop,
            "identification": identification(fit, fms[arch], pts, params_ci95, isoflop, e_samples=(
                params_boot[:, PARAM_NAMES.index("E")] if params_boot is not None and len(params_boot) else None)),
            "replicates": replicate_spread(runs_by_arch[arch]),
        }
        if arch != base and base is not None:
            s = compute_savings(fits[base].law, fms[base], fit.law, fms[arch], C_grid)
            slo, shi = percentile_interval(b.get("saving"))
            dlo, dhi = percentile_interval(b.get("loss_delta"))
            archs[arch]["savings"] = {k: v.tolist() for k, v in s.items()}
            archs[arch]["savings_ci95"] = [slo.tolist(), shi.tolist()] if slo is not None and shi is not None else None
            archs[arch]["loss_delta_ci95"] = ([dlo.tolist(), dhi.tolist()] if dlo is not None and dhi is not None
                                              else None)
            archs[arch]["envelope_savings"] = envelope_savings(envelope(by_arch[base]), envelope(pts))
            archs[arch]["paired"] = paired_comparison(runs_by_arch[base], runs_by_arch[arch])
    return {"law": "L(N, D) = E + A / N^alpha + B / D^beta",
            "units": {"loss": "nats/token (validation)", "N": "non-embedding parameters (embedding and output "
                      "head excluded, all experts counted)", "D": "training tokens",
                      "C": "training FLOPs = f(N) * D, f = training FLOPs/token from the budget (3x forward, "
                           "every visit counted)"},
            "method": {"huber_delta": HUBER_DELTA, "n_starts": n_starts, "n_bootstrap": n_bootstrap, "seed": seed,
                       "source": "Hoffmann et al. 2022 (arXiv 2203.15556) Approach 3, Appendix D.2"},
            "baseline": base, "C_measured": [cmin, cmax], "C_grid": C_grid.tolist(),
            "runs": [_point_dict(p) for p in points], "excluded": [asdict(e) for e in excluded],
            "architectures": archs}


def _pooled_sd(groups: list[list[float]]) -> float | None:
    """Pooled sample standard deviation of the groups with 2 or more values (None without any)."""
    dof = sum(len(g) - 1 for g in groups if len(g) > 1)
    if dof == 0:
        return None
    return float(np.sqrt(sum(float(np.sum((np.array(g) - np.mean(g)) ** 2)) for g in groups if len(g) > 1) / dof))


def replicate_spread(points: list[RunPoint]) -> dict[str, Any] | None:
    """Run-to-run spread of the final loss between seeds: per design point with 2 or more runs
    (:meth:`~smelt_ds.study.scaling.collect.RunPoint.point_key`) its seeds and losses, and the pooled
    sample standard deviation over those points (nats/token). None without replicates."""
    groups: dict[tuple, list[RunPoint]] = {}
    for p in points:
        groups.setdefault(p.point_key(), []).append(p)
    reps = [g for g in groups.values() if len(g) > 1]
    if not reps:
        return None
    return {"points": len(reps), "pooled_sd": _pooled_sd([[p.loss for p in g] for g in reps]),
            "groups": [{"size": g[0].size, "budget": g[0].budget, "N": g[0].N, "D": g[0].D,
                        "seeds": [p.seed for p in g], "losses": [p.loss for p in g]} for g in reps]}


def paired_comparison(base_pts: list[RunPoint], other_pts: list[RunPoint], rel_tol: float = 0.02
                      ) -> dict[str, Any] | None:
    """Loss differences of runs matched one to one, without any fit: a run of the other
    architecture pairs with the Baseline run of the same sweep size, budget and seed (labels from
    ``sweep_run.json``), else with the Baseline run of the same tokens ``D`` whose ``N`` is within
    ``rel_tol``. In a budget-matched sweep each pair has equal N, D and training FLOPs (within the
    matcher's tolerance), so ``delta = loss_X - loss_Baseline`` (nats/token; negative: X better)
    compares the architectures at equal compute directly.

    Pairs of the same design point (size and budget; replicates of other seeds) are averaged into
    one point delta first, so the test runs over design points: ``mean_delta`` is the mean of the
    point deltas, ``ci95`` the paired t interval over points (``scipy.stats.ttest_rel`` of the
    points' mean losses), ``p_value`` two-sided; ``seed_sd`` is the pooled standard deviation of a
    pair's delta between seeds (points with 2 or more seeds; the run-to-run noise of one pair).

    Returns ``{"n_pairs" (design points), "n_runs_pairs" (pairs of runs), "mean_delta", "ci95",
    "p_value", "wins" (points with delta < 0), "seed_sd", "replicated_points", "by_budget"
    ({budget: mean point delta}), "pairs": [{"size", "budget", "N", "D", "C", "loss",
    "baseline_loss", "delta", "seeds", "deltas"}], "unpaired"}``, or None without pairs.
    """
    from scipy import stats

    points: dict[tuple, list[tuple[RunPoint, RunPoint]]] = {}
    unpaired = 0
    for p in other_pts:
        if p.size is not None and p.budget is not None:
            match = [b for b in base_pts if b.size == p.size and b.budget == p.budget and b.seed == p.seed]
        else:
            match = [b for b in base_pts if b.D == p.D and abs(b.N - p.N) <= rel_tol * b.N and b.seed == p.seed]
        if len(match) != 1:
            unpaired += 1
            continue
        points.setdefault(p.point_key()[1:], []).append((p, match[0]))
    if not points:
        return None
    pairs: list[dict[str, Any]] = []
    for g in points.values():
        p = g[0][0]
        deltas = [q.loss - b.loss for q, b in g]
        pairs.append({"size": p.size, "budget": p.budget, "N": p.N, "D": p.D, "C": p.C,
                      "loss": float(np.mean([q.loss for q, _ in g])),
                      "baseline_loss": float(np.mean([b.loss for _, b in g])),
                      "delta": float(np.mean(deltas)), "seeds": [q.seed for q, _ in g], "deltas": deltas})
    x = np.array([q["loss"] for q in pairs])
    y = np.array([q["baseline_loss"] for q in pairs])
    out: dict[str, Any] = {"n_pairs": len(pairs), "n_runs_pairs": sum(len(g) for g in points.values()),
                           "mean_delta": float(np.mean(x - y)), "ci95": None, "p_value": None,
                           "wins": int(np.sum(x < y)), "seed_sd": _pooled_sd([q["deltas"] for q in pairs]),
                           "replicated_points": sum(len(q["deltas"]) > 1 for q in pairs),
                           "unpaired": unpaired, "pairs": pairs}
    if len(pairs) >= 2 and np.std(x - y) > 0:
        t = stats.ttest_rel(x, y)
        ci = t.confidence_interval(0.95)
        out["ci95"], out["p_value"] = [float(ci.low), float(ci.high)], float(t.pvalue)
    by_budget: dict[str, list[float]] = {}
    for q in pairs:
        by_budget.setdefault(q["budget"] or f"D={q['D']:.3g}", []).append(q["delta"])
    out["by_budget"] = {k: float(np.mean(v)) for k, v in by_budget.items()}
    return out


def _point_dict(p: RunPoint) -> dict[str, Any]:
    return {**asdict(p), "C": p.C}
